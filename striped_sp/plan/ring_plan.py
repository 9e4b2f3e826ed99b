"""RingPlan: one rank's compiled plan for one batch, built once and run by every layer and pass.

A plan holds everything the executor (:mod:`striped_sp.engine.autograd`) needs, so that running it
does no planning, no host<->device copy and no synchronisation:

* ``steps``: how many ring steps carry visible keys (a window cuts the ring short; a row whose
  documents all stay whole on their ranks needs one step and no transfer);
* ``calls[t]``: the kernel calls of step ``t`` (the block of source rank ``(rank - t) % N``), of one
  call type per plan: :class:`~striped_sp.plan.layouts.BlockCall` slices for the dense ring,
  :class:`~striped_sp.plan.masks.SegmentCall` band segments under documents or windows;
* ``programs[t]``: for masked plans, each call compiled for the kernel, the batch size and the
  device (:func:`striped_sp.kernels.varlen.compile_call`): the schedule's gather/scatter indices and
  masks, or the native varlen calls' int32 cu_seqlens and row indices by window; all placed on the
  device with one copy (:class:`~striped_sp.kernels.arena.Arena`);
* ``shared``: per rank, the leading rows the ring carries (``None``: all of them);
* ``order`` / ``inverse``: the layout's :meth:`~striped_sp.plan.layouts.Layout.run_order` (int64
  row indices on the device, placed with the plan) when the rows run in another order than the
  caller's (a ring of one of hierarchical CP runs its gathered tokens in natural order), else ``None``;
* ``fmt``: the tensor format of the forward (the kernel's own for dense plans, ``"bshd"`` masked);
  ``aligned``: the striped strict block in its aligned form;
* ``entries[t]``: visible score entries of step ``t`` per batch row and head (the work);
  ``predicted_ms[t]``: its forward time per head on the cost model of the kernel on the device
  (:func:`striped_sp.plan.cost.model_for`: the calibrated one where adopted, else the table's;
  ``cost_model`` names it, and says when it is a prediction rather than a measurement); the same
  model prices the schedule's halving and size classes.
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels.schedule import class_rule, halving_rule
from ..kernels.segments import Segments
from ..kernels.varlen import Arena, compile_steps
from .cost import model_for
from .masks import MaskSpec, ring_plans
from .ring_blocks import all_shared_rows

__all__ = ["RingPlan", "HostPlan", "build_host_plan", "compile_plan", "build_ring_plan"]


class Decision:
    """A value made when first read: a row's decision line (``Layout.decision``; pricing zigzag
    beside the striped plans for it costs about a search's worth on a long packed row, every
    batch), or a plan's predicted step times (a pass over every segment, for reports only)."""

    def __init__(self, make):
        self._make, self._text = make, None

    def get(self) -> str | None:
        if self._make is not None:
            self._text, self._make = self._make(), None
        return self._text


@dataclasses.dataclass
class RingPlan:
    world_size: int
    rank: int
    local_len: int
    steps: int
    calls: tuple
    shared: tuple | None
    fmt: str
    aligned: bool
    entries: tuple
    kernel: object
    scale: float
    comm_dtype: torch.dtype
    masked: bool
    programs: tuple | None = None
    arena: Arena | None = None
    #: :attr:`predicted_ms`, made when first read
    predicted_of: "Decision | None" = dataclasses.field(default=None, compare=False)
    cost_model: str = ""
    order: torch.Tensor | None = None  # run row p is the caller's row order[p]
    inverse: torch.Tensor | None = None  # the caller's row t is run row inverse[t]
    #: what the layout chose for this row and why, made when first read (:attr:`decision`)
    decision_of: "Decision | None" = dataclasses.field(default=None, compare=False)

    @property
    def decision(self) -> str | None:
        """What the layout chose for this row and why (``Layout.decision``: the striped search's
        choice, its predicted time, the runner-up, zigzag where predicted faster); ``None``: a fixed
        layout."""
        return None if self.decision_of is None else self.decision_of.get()

    @property
    def predicted_ms(self) -> tuple:
        """Per step, the forward time per head of its calls on :attr:`cost_model`, in ms."""
        return () if self.predicted_of is None else self.predicted_of.get()

    def launches(self, step: int) -> int:
        """Kernel calls of ``step`` per forward (the same per backward)."""
        if not self.masked:
            return len(self.calls[step])
        return sum(p.launches() for p in self.programs[step])

    def gathered_keys(self, step: int) -> int:
        """Key rows that ``step`` gathers per forward (the values' the same; 0 for a dense plan,
        which runs on the blocks as they are)."""
        return sum(p.gathered_keys() for p in self.programs[step]) if self.masked else 0


@dataclasses.dataclass(frozen=True)
class HostPlan:
    """The kernel-independent part of a plan: what a batch's documents and window decide (steps,
    calls, shared rows, entries), built once per batch where the batch is made, or by the first
    layer that needs it; :func:`compile_plan` turns it into a :class:`RingPlan` for a kernel and
    device."""

    world_size: int
    rank: int
    local_len: int
    steps: int
    calls: tuple
    shared: tuple | None
    entries: tuple
    causal: bool
    masked: bool
    order: torch.Tensor | None = None  # the layout's run_order (CPU int64), None: the caller's order
    decision_of: "Decision | None" = dataclasses.field(default=None, compare=False)  # RingPlan.decision

    @property
    def decision(self) -> str | None:
        return None if self.decision_of is None else self.decision_of.get()

    @property
    def predicted_ms(self) -> tuple:
        """Per step, the forward time per head of its calls on :attr:`cost_model`, in ms."""
        return () if self.predicted_of is None else self.predicted_of.get()


def build_host_plan(layout, mask: MaskSpec | None, causal: bool, world_size: int, rank: int,
                    local_len: int) -> HostPlan:
    """The :class:`HostPlan` of ``rank`` of ``world_size`` (``mask`` ``None``: the dense ring)."""
    n = local_len
    order = layout.run_order(n * world_size, world_size, rank, None if mask is None else mask.bounds)
    decision = Decision(lambda: layout.decision(n * world_size, world_size, None if mask is None else mask.bounds))
    if mask is None:
        calls = tuple(tuple(layout.plan(rank, (rank - t) % world_size, world_size, n, causal))
                      for t in range(world_size))
        entries = tuple(sum(c.score_entries(n) for c in step) for step in calls)
        return HostPlan(world_size, rank, n, world_size, calls, None, entries, causal, masked=False, order=order,
                        decision_of=decision)
    steps = layout.ring_steps(world_size, n, mask)
    shared = None
    if steps > 1:
        rows = all_shared_rows(layout, mask, world_size)
        shared = None if all(s == n for s in rows) else rows
        if not any(rows):  # every document whole on its rank: no rank sees another's keys, no ring
            steps, shared = 1, None
    calls = tuple(tuple(step) for step in ring_plans(layout, mask, world_size, rank, steps))
    entries = tuple(sum(c.entries for c in step) for step in calls)
    return HostPlan(world_size, rank, n, steps, calls, shared, entries, causal, masked=True, order=order,
                    decision_of=decision)


def _predicted_ms(host: HostPlan, model) -> tuple:
    """Per step, the model's forward time per head of the step's calls, in milliseconds (a masked
    plan's segments priced in one pass over all its calls)."""
    if not host.masked:
        n = host.local_len
        return tuple(sum(model.call(c.q_len(n), c.kv_len(n), c.causal) for c in step) / 1e6 for step in host.calls)
    segs = [c.segments for step in host.calls for c in step]
    per_step = torch.zeros(len(host.calls), dtype=torch.float64)
    if segs:
        step_of = torch.repeat_interleave(torch.tensor([t for t, step in enumerate(host.calls) for _ in step]),
                                          torch.tensor([len(s) for s in segs]))
        per_step.index_add_(0, step_of, model.each_segment_ns(_joined(segs)))
    return tuple((per_step / 1e6).tolist())


def _joined(segs: list) -> Segments:
    """Many calls' segments as one :class:`Segments` (their rows re-based; entries as counted)."""
    zero = torch.zeros(1, dtype=torch.int64)
    lq, lk = torch.cat([s.lq for s in segs]), torch.cat([s.lk for s in segs])
    out = Segments(torch.cat([zero, torch.cumsum(lq, 0)]), torch.cat([zero, torch.cumsum(lk, 0)]),
                   torch.cat([s.wl for s in segs]), torch.cat([s.wr for s in segs]))
    out.__dict__["_entries"] = torch.cat([s.segment_entries() for s in segs])
    return out


def _work(model, heads: int, batch: int, head_dim: int | None) -> tuple[float, float]:
    """``(work, passes)``: the model's table is per head of 64 and one pass."""
    return max(heads, 1) * max(batch, 1) * (head_dim or 64) / 64, 1 + model.backward_factor


def _halving(model, heads: int, batch: int, head_dim: int | None):
    """The schedule's halving rule for calls of ``batch`` x ``heads`` heads of ``head_dim``: the
    model's kernel time of both passes against the host time of the two more calls, each forward
    and backward, that one halving makes."""
    work, passes = _work(model, heads, batch, head_dim)
    return halving_rule(lambda rows, keys, causal: model.call(rows, keys, causal) * work * passes,
                        2 * model.host_ns_per_call)


def _classes(model, heads: int, batch: int, head_dim: int | None):
    """The schedule's size classes of small causal squares: each square's padded compute (both
    passes) against what a batched call costs beside it (its launch and host work, both passes)."""
    work, passes = _work(model, heads, batch, head_dim)
    return class_rule(lambda c: (model.call(c, c, True) - model.call_ns) * work * passes,
                      model.call_ns * work * passes + 2 * model.host_ns_per_batch)


def compile_plan(host: HostPlan, *, kernel, scale: float, comm_dtype: torch.dtype = torch.float32,
                 strict_block: str = "sliced", device="cpu", dtype=torch.float32, head_dim: int | None = None,
                 batch: int = 1, heads: int = 1) -> RingPlan:
    """``host`` compiled for ``kernel`` on ``device`` / ``dtype`` / ``head_dim`` and ``batch`` rows
    of ``heads`` query heads: masked plans get their programs, placed on the device with one copy.
    Priced by :func:`~striped_sp.plan.cost.model_for` of the kernel on the device's type (the model
    adopted by a calibration of that kernel there, else the table's)."""
    device = torch.device(device)
    model = model_for(kernel.name, device.type)
    cost = dict(predicted_of=Decision(lambda: _predicted_ms(host, model)), cost_model=model.label,
                decision_of=host.decision_of)
    arena = Arena()
    order = _order_slots(host.order, arena)
    if not host.masked:
        arena.place(device)
        return RingPlan(host.world_size, host.rank, host.local_len, host.steps, host.calls, None,
                        kernel.tensor_format, strict_block == "aligned", host.entries, kernel, scale, comm_dtype,
                        masked=False, arena=arena, **cost, **_placed(order))
    n = host.local_len
    programs = compile_steps(kernel, [[c.segments for c in step] for step in host.calls], batch, n, n, device, dtype,
                             head_dim, arena, _halving(model, heads, batch, head_dim),
                             _classes(model, heads, batch, head_dim))
    arena.place(device)
    return RingPlan(host.world_size, host.rank, n, host.steps, host.calls, host.shared, "bshd", False, host.entries,
                    kernel, scale, comm_dtype, masked=True, programs=programs, arena=arena, **cost, **_placed(order))


def _order_slots(order: torch.Tensor | None, arena: Arena):
    """The run order and its inverse added to the plan's arena (they travel in its one copy)."""
    if order is None:
        return None
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel())
    return arena.add(order), arena.add(inverse)


def _placed(slots) -> dict:
    return {} if slots is None else dict(order=slots[0].t, inverse=slots[1].t)


def build_ring_plan(layout, mask: MaskSpec | None, causal: bool, world_size: int, rank: int, local_len: int, *,
                    kernel, scale: float, comm_dtype: torch.dtype = torch.float32, strict_block: str = "sliced",
                    device="cpu", dtype=torch.float32, head_dim: int | None = None, batch: int = 1,
                    heads: int = 1) -> RingPlan:
    """The plan of ``rank`` of ``world_size`` for one batch: ``mask`` ``None`` for the dense ring
    (plain causal or full attention on a layout with dense plans), else the checked mask of the
    global row.  Masked plans are compiled for ``kernel`` on ``device`` / ``dtype`` / ``head_dim``
    and ``batch`` rows of ``heads`` query heads, and placed on the device once."""
    return compile_plan(build_host_plan(layout, mask, causal, world_size, rank, local_len), kernel=kernel,
                        scale=scale, comm_dtype=comm_dtype, strict_block=strict_block, device=device, dtype=dtype,
                        head_dim=head_dim, batch=batch, heads=heads)
