"""Varlen calls (many band segments at once) straight into the ring's accumulators, from programs
compiled once per batch.

``q`` ``[b, Lq, h, d]`` and ``k``/``v`` ``[b, Lk, kv_heads, d]`` are a rank's whole local tensors;
the segments say which rows take part (:class:`~striped_sp.kernels.segments.Segments`).  Forward
merges each result into float32 accumulators ``acc_out`` ``[b, Lq, h, d]`` / ``acc_lse``
``[b, h, Lq]`` (rows not seen yet hold 0 / -inf); backward adds float32 gradients into ``dq`` /
``dk`` / ``dv``.  No input is copied as a whole: direct calls take slices, batched calls gather
only their rows.

A call runs from a *program* compiled once per batch (:func:`compile_call`), which holds every
index, mask and ``cu_seqlens`` it needs, already on the device (all of a plan's in one copy, by an
:class:`Arena`).  Running a program does no host work beyond its kernel calls: no index is built,
nothing is copied to the device, nothing waits for the device.

* :class:`ScheduledCall`: kernels without a varlen entry point, through the pieces of
  :func:`striped_sp.kernels.schedule.schedule` (a row may be covered by several pieces);
* :class:`~striped_sp.kernels.native.NativeCall`: kernels with one (flash-attn, PyTorch's CUDA
  flash op), called once per window class on the gathered rows (:mod:`striped_sp.kernels.native`).
"""

from __future__ import annotations

import dataclasses

import torch

from .arena import Arena, Slot
from .direct import DirectLayer, as_format, direct_layers, layer_backward, layer_forward
from .merge import merge_block_safe as _merge
from .merge import merge_rows as _merge_rows
from .native import NativeCall, native_programs
from .schedule import TILE, Batch, Schedule, schedule, schedule_steps
from .segments import Segments, _ranges

__all__ = ["TILE", "Arena", "ScheduledCall", "NativeCall", "compile_call", "compile_steps", "native_programs"]


@dataclasses.dataclass
class _Batch:
    """A :class:`~striped_sp.kernels.schedule.Batch` compiled for a batch size: every index and
    mask it needs, as slots."""

    packs: int
    cq: int
    ck: int
    strided: tuple | None
    mask: Slot | None          # [b * packs or 1, 1, cq, ck], bool or the kernel.compile_mask form (None: dense)
    q_index: Slot | None        # [packs * cq] local rows gathered (None when strided); padding slots: row 0
    k_index: Slot | None
    q_pad: Slot | None          # the padding slots (backward zeroes them)
    causal: bool = False        # no mask, each entry a causal square


def _v(slot: Slot | None):
    return None if slot is None else slot.t


def _compile_batch(p: Batch, b: int, arena: Arena, mask_form) -> _Batch:
    mask = p.mask
    if mask is not None and b > 1 and mask.size(0) > 1:
        mask = mask.unsqueeze(0).expand(b, *mask.shape).reshape(b * p.packs, 1, p.cq, p.ck)
    if mask is not None:
        mask = mask_form(mask)
    strided = p.strided if b == 1 else None
    if strided is not None:
        return _Batch(p.packs, p.cq, p.ck, strided, arena.add(mask), None, None, None, p.causal)
    return _Batch(p.packs, p.cq, p.ck, None, arena.add(mask), arena.add(p.q_index), arena.add(p.k_index),
                  arena.add(p.pad_slots()), p.causal)


@dataclasses.dataclass
class _Layer:
    """Results merged into the accumulators at once: the direct pieces of one
    :class:`~striped_sp.kernels.direct.DirectLayer` and batches whose rows none of them has.  Their
    outputs are concatenated in order (a batch's with its padding slots); ``keep``: the positions
    of that concatenation that hold real rows (``None``: all); ``rows``: those positions' local
    rows, distinct; ``span``: ``(a, b)`` when they are ``a .. b - 1`` in order (a slice, no index)."""

    direct: DirectLayer | None
    batches: list
    keep: Slot | None
    rows: Slot | None
    span: tuple | None
    alone: tuple = ()     # the direct pieces (their indices) of at least SPAN_ROWS rows: merged on their slices
    pooled: tuple = ()    # the other direct pieces, concatenated first


#: a direct piece or strided batch of at least this many rows is merged alone, on its slice of the
#: accumulators, rather than concatenated with others (at 8 heads of 64 that copy is megabytes)
SPAN_ROWS = 1024


def _layers(direct: list, batches: list, plan_batches: list, nq: int, arena: Arena) -> list:
    """The merge layers of a call: one per direct layer, each batch in the first layer that has
    none of its rows (a new one if none; a long strided batch always a layer of its own)."""
    taken, piece_rows, parts = [], [], []
    for layer in direct:
        spans = layer.rows
        alone = tuple(i for i, (a, b) in enumerate(spans) if b - a >= SPAN_ROWS)
        pooled = tuple(i for i, (a, b) in enumerate(spans) if b - a < SPAN_ROWS)
        parts.append((alone, pooled))
        span = torch.tensor([spans[i] for i in pooled], dtype=torch.int64).view(-1, 2)
        rows = _ranges(span[:, 0], span[:, 1] - span[:, 0])
        occ = torch.zeros(nq, dtype=torch.bool)
        occ[rows] = True
        for i in alone:
            occ[spans[i][0]:spans[i][1]] = True
        taken.append(occ)
        piece_rows.append(rows)
    rows_of = [src.real_rows() for src in plan_batches]
    members = _assign(taken, rows_of, plan_batches, nq)
    out = []
    for i, found in enumerate(members):
        rows = ([piece_rows[i]] if i < len(direct) else []) + [rows_of[j] for j in found]
        rows = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
        srcs = [plan_batches[j] for j in found]
        padded = any(src.q_real is not None for src in srcs)
        keep = None
        if padded:  # the real slots' places in the layer's concatenated results, all at once
            at = piece_rows[i].numel() if i < len(direct) else 0
            slots = [src.packs * src.cq for src in srcs]
            local = [torch.arange(at)] + [torch.arange(n) if src.q_real is None else src.q_real
                                          for src, n in zip(srcs, slots)]
            firsts = torch.tensor([0] + slots).cumsum(0)[:-1] + at
            keep = torch.cat(local) + torch.repeat_interleave(
                torch.cat([torch.zeros(1, dtype=torch.int64), firsts]), torch.tensor([x.numel() for x in local]))
        span = None
        if rows.numel():
            first, n = int(rows[0]), rows.numel()
            # rows are distinct: a run in order when it ends where a run would, and steps by one
            if int(rows[-1]) == first + n - 1 and bool((rows[1:] - rows[:-1] == 1).all()):
                span = (first, first + n)
        alone, pooled = parts[i] if i < len(direct) else ((), ())
        out.append(_Layer(direct[i] if i < len(direct) else None, [batches[j] for j in found],
                          arena.add(keep), None if span is not None or not rows.numel() else arena.add(rows),
                          span, alone, pooled))
    return out


def _assign(taken: list, rows_of: list, plan_batches: list, nq: int) -> list:
    """Each batch's merge layer (``members[i]``: the batches of layer ``i``), first fit on the
    layers' rows ``taken`` (bool ``[nq]``, one per direct layer; may be updated).  Batches that share no
    row with each other or with the first layer all join it, found in one pass (packed
    documents: the usual case; batches of one schedule group share none by construction, see
    :attr:`~striped_sp.kernels.batched.Batch.group`); otherwise one by one."""
    members = [[] for _ in taken]
    if not rows_of:
        return members
    alone = [src.strided is not None and src.packs * src.cq >= SPAN_ROWS for src in plan_batches]
    if not any(alone):
        groups = {src.group for src in plan_batches}
        if groups == {0} or groups == {3}:
            clash = False
        else:
            every = torch.cat(rows_of)
            clash = (bool((torch.bincount(every, minlength=nq) > 1).any())
                     or (bool(taken[0][every].any()) if taken else False))
        if not clash:
            if not taken:
                members.append([])
            members[0] = list(range(len(rows_of)))
            return members
    for j, (rows, own) in enumerate(zip(rows_of, alone)):
        for i, occ in enumerate(taken):
            if not own and not bool(occ[rows].any()):
                break
        else:
            i = len(taken)
            taken.append(torch.ones(nq, dtype=torch.bool) if own else torch.zeros(nq, dtype=torch.bool))
            members.append([])
        taken[i][rows] = True
        members[i].append(j)
    return members


class ScheduledCall:
    """A varlen call for kernels without a varlen entry point: the direct calls on slices and
    batched masked calls of its :class:`~striped_sp.kernels.schedule.Schedule`, compiled for batch
    size ``b``, ``nq`` local query rows and ``nk`` key rows; their forward results merged once per
    layer of distinct rows, the direct calls' views taken once per layer
    (:mod:`~striped_sp.kernels.direct`)."""

    def __init__(self, plan: Schedule, b: int, arena: Arena, nq: int, nk: int, mask_form=None):
        self.direct = plan.direct
        self.direct_layers = direct_layers(plan.direct)
        form = mask_form or (lambda m: m)
        self.batches = [_compile_batch(p, b, arena, form) for p in plan.batches]
        self.layers = _layers(self.direct_layers, self.batches, plan.batches, nq, arena)

    def launches(self) -> int:
        """Kernel calls per forward (the same per backward)."""
        return len(self.direct) + len(self.batches)

    def gathered_keys(self) -> int:
        """Key rows gathered per forward (the values' the same): the slots of the batches that are
        no strided view (direct pieces take slices)."""
        return sum(p.k_index.t.numel() for p in self.batches if p.strided is None)

    def forward(self, kernel, q, k, v, scale, acc_out, acc_lse) -> None:
        fmt = kernel.tensor_format  # the direct pieces' results are in it: concatenated in it
        sd = 1 if fmt == "bshd" else 2
        for layer in self.layers:
            outs, lses = ([], []) if layer.direct is None else layer_forward(layer.direct, kernel, q, k, v, scale)
            for i in layer.alone:
                a, b = layer.direct.pieces[i][:2]
                _merge(acc_out[:, a:b], acc_lse[:, :, a:b], as_format(outs[i], fmt), lses[i])
            if layer.alone:
                outs, lses = [outs[i] for i in layer.pooled], [lses[i] for i in layer.pooled]
            if not outs and not layer.batches:
                continue
            for p in layer.batches:
                o, l = _batch_forward(kernel, p, q, k, v, scale)
                outs.append(as_format(o, fmt))
                lses.append(l)
            out = as_format(outs[0] if len(outs) == 1 else torch.cat(outs, sd), fmt)
            lse = lses[0] if len(lses) == 1 else torch.cat(lses, 2)
            if layer.keep is not None:
                out, lse = out.index_select(1, layer.keep.t), lse.index_select(2, layer.keep.t)
            if layer.span is not None:
                a, b = layer.span
                _merge(acc_out[:, a:b], acc_lse[:, :, a:b], out, lse)
            else:
                _merge_rows(acc_out, acc_lse, layer.rows.t, out, lse)

    def backward(self, kernel, dout, q, k, v, out, lse, scale, dq, dk, dv) -> None:
        b, _, h, d = q.shape
        for layer in self.direct_layers:
            layer_backward(layer, kernel, dout, q, k, v, out, lse, scale, dq, dk, dv)
        for p in self.batches:
            mask = _v(p.mask)
            if p.strided is not None:
                _strided_backward(kernel, p, dout, q, k, v, out, lse, mask, scale, dq, dk, dv)
                continue
            qi, ki = p.q_index.t, p.k_index.t
            do_b, q_b = _gather(dout, qi, p.packs, p.cq), _gather(q, qi, p.packs, p.cq)
            lse_b = lse.index_select(2, qi)
            if p.q_pad is not None:
                # padding rows: query 0 (every score 0, so exp(score - lse) = 1 with lse 0) and output
                # gradient 0: they add nothing to any gradient, however large the real scores are
                pad = p.q_pad.t
                do_b.view(b, p.packs * p.cq, h, -1).index_fill_(1, pad, 0)  # v's head dim (MLA)
                q_b.view(b, p.packs * p.cq, h, d).index_fill_(1, pad, 0)
                lse_b.index_fill_(2, pad, 0)
            lse_b = lse_b.view(b, h, p.packs, p.cq).transpose(1, 2).reshape(b * p.packs, h, p.cq)
            args = (do_b, q_b, _gather(k, ki, p.packs, p.ck), _gather(v, ki, p.packs, p.ck),
                    _gather(out, qi, p.packs, p.cq), lse_b.contiguous())
            g = kernel.backward(*args, p.causal, scale) if mask is None else kernel.backward_masked(*args, mask, scale)
            # every slot's gradients, padding slots' included: those are exact zeros (a padding
            # row's output gradient is 0, and a padding key is seen by padding rows alone), added
            # to row 0, which their index names
            _index_add_rows(dq, qi, _flat(g[0], b, p.packs, p.cq).to(dq.dtype))
            _index_add_rows(dk, ki, _flat(g[1], b, p.packs, p.ck).to(dk.dtype))
            _index_add_rows(dv, ki, _flat(g[2], b, p.packs, p.ck).to(dv.dtype))


def _batch_forward(kernel, p: _Batch, q, k, v, scale) -> tuple:
    """One batched call's results over all its slots: ``[b, packs * cq, h, dv]``, ``[b, h, packs * cq]``."""
    b, _, h, _ = q.shape
    mask = _v(p.mask)
    if p.strided is not None:
        qf, kf, step = p.strided
        o, l = _attend(kernel, _windows(q, qf, p.cq, p.packs, p.cq), _windows(k, kf, step, p.packs, p.ck),
                       _windows(v, kf, step, p.packs, p.ck), mask, scale, p.causal)
        return o.reshape(1, p.packs * p.cq, *o.shape[2:]), l.transpose(0, 1).reshape(1, h, p.packs * p.cq)
    qi, ki = p.q_index.t, p.k_index.t
    o, l = _attend(kernel, _gather(q, qi, p.packs, p.cq), _gather(k, ki, p.packs, p.ck), _gather(v, ki, p.packs, p.ck),
                   mask, scale, p.causal)
    return _flat(o, b, p.packs, p.cq), l.view(b, p.packs, h, p.cq).transpose(1, 2).reshape(b, h, p.packs * p.cq)


def _index_add_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[:, rows] += src`` (``dst`` ``[b, L, ...]``, ``src`` ``[b, R, ...]``): for one contiguous
    batch row as one 2-D ``index_add_`` over dim 0, which the CPU runs several times faster than
    the same add over dim 1 (0.1 vs 0.46 ms for 4000 rows of 1 x 8 on this CPU)."""
    if dst.size(0) == 1 and dst.is_contiguous():
        dst.view(dst.size(1), -1).index_add_(0, rows, src.reshape(src.size(1), -1))
    else:
        dst.index_add_(1, rows, src)


def _gather(x: torch.Tensor, index: torch.Tensor, packs: int, width: int) -> torch.Tensor:
    """Rows ``index`` of ``x`` ``[b, L, h, d]`` as a batch ``[b * packs, width, h, d]``."""
    return x.index_select(1, index).view(x.size(0) * packs, width, *x.shape[2:])


def _flat(x: torch.Tensor, b: int, packs: int, width: int) -> torch.Tensor:
    return x.reshape(b, packs * width, *x.shape[2:])


def _windows(x: torch.Tensor, first: int, step: int, count: int, width: int) -> torch.Tensor:
    """``count`` windows of ``width`` rows of ``x`` ``[1, L, h, d]``, ``step`` rows apart, as one
    strided view ``[count, width, h, d]`` (windows may overlap: read only)."""
    s = x.stride()
    return x.as_strided((count, width, *x.shape[2:]), (step * s[1], s[1], *s[2:]), x.storage_offset() + first * s[1])


def _add_windows(acc: torch.Tensor, value: torch.Tensor, first: int, step: int, width: int) -> None:
    """``acc`` windows (as :func:`_windows`) += ``value`` ``[count, width, ...]``; overlapping
    windows are added in phases that do not overlap."""
    count = value.size(0)
    phases = max(1, -(-width // step))
    for ph in range(min(phases, count)):
        part = value[ph::phases]
        _windows(acc, first + ph * step, phases * step, part.size(0), width).add_(part)


def _strided_backward(kernel, p: _Batch, dout, q, k, v, out, lse, mask, scale, dq, dk, dv) -> None:
    qf, kf, step = p.strided
    r1 = qf + p.packs * p.cq
    h = q.size(2)
    lse_b = lse[0, :, qf:r1].reshape(h, p.packs, p.cq).transpose(0, 1).contiguous()
    args = (_windows(dout, qf, p.cq, p.packs, p.cq), _windows(q, qf, p.cq, p.packs, p.cq),
            _windows(k, kf, step, p.packs, p.ck), _windows(v, kf, step, p.packs, p.ck),
            _windows(out, qf, p.cq, p.packs, p.cq), lse_b)
    g = kernel.backward(*args, p.causal, scale) if mask is None else kernel.backward_masked(*args, mask, scale)
    dq[:, qf:r1] += g[0].reshape(1, p.packs * p.cq, *g[0].shape[2:])
    _add_windows(dk, g[1].to(dk.dtype), kf, step, p.ck)
    _add_windows(dv, g[2].to(dv.dtype), kf, step, p.ck)


def _attend(kernel, q, k, v, mask, scale, causal: bool = False):
    return kernel.forward(q, k, v, causal, scale) if mask is None else kernel.forward_masked(q, k, v, mask, scale)


# -- kernels with a native varlen entry point (flash-attn, PyTorch's CUDA flash op) ------------

def compile_call(kernel, segs: Segments, b: int, nq: int, nk: int, device, dtype, head_dim: int | None,
                 arena: Arena, halve=None) -> "ScheduledCall | NativeCall":
    """The program of one varlen call for ``kernel`` on ``device`` / ``dtype`` (its slots in
    ``arena``, placed by the caller); ``halve``: the schedule's
    :func:`~striped_sp.kernels.schedule.halving_rule` (kernels without a varlen entry point)."""
    if kernel.native_varlen(torch.device(device), dtype, head_dim):
        return native_programs([segs], b, nq, nk, arena)[0]
    return ScheduledCall(schedule(segs, halve), b, arena, nq, nk, _mask_form(kernel, device, dtype))


def _mask_form(kernel, device, dtype):
    return lambda m: kernel.compile_mask(m, torch.device(device), dtype)


def compile_steps(kernel, steps: list, b: int, nq: int, nk: int, device, dtype, head_dim: int | None, arena: Arena,
                  halve=None, classes=None) -> tuple:
    """The programs of a plan's varlen calls (``steps[t]``: step ``t``'s :class:`Segments`), as
    ``steps`` is nested: native ones compiled together (:func:`native_programs`), scheduled ones
    scheduled together (:func:`~striped_sp.kernels.schedule.schedule_steps`, with the plan's
    ``halve`` and ``classes`` rules), one program per distinct call; native ones one program per
    step, whose calls share their launches."""
    if not kernel.native_varlen(torch.device(device), dtype, head_dim):
        # every distinct call's schedule derived at once; steps of the same segments (zigzag's
        # padded documents: every step but the first alike) share one program, which only reads
        # its slots
        keys = [[_content(segs) for segs in step] for step in steps]
        distinct = {}
        for step, step_keys in zip(steps, keys):
            for segs, key in zip(step, step_keys):
                distinct.setdefault(key, segs)
        form = _mask_form(kernel, device, dtype)
        programs = {key: ScheduledCall(plan, b, arena, nq, nk, form)
                    for key, plan in zip(distinct, schedule_steps(list(distinct.values()), halve, classes))}
        return tuple(tuple(programs[key] for key in step_keys) for step_keys in keys)
    # a step's calls share their launches, one per window class (module docstring of kernels/native.py)
    calls = [segs for step in steps for segs in step]
    sets = [t for t, step in enumerate(steps) for _ in step]
    programs = native_programs(calls, b, nq, nk, arena, launch_sets=sets) if calls else []
    return tuple((programs[t],) if step else () for t, step in enumerate(steps))


def _content(segs: Segments) -> bytes:
    """The segments' values (equal for equal segments)."""
    parts = (segs.cu_q, segs.cu_k, segs.wl, segs.wr, segs.q_start, segs.k_start)
    return torch.tensor([t.numel() for t in parts]).numpy().tobytes() + torch.cat(parts).numpy().tobytes()


def as_program(kernel, call, q: torch.Tensor, k: torch.Tensor):
    """``call`` as a program: a compiled one as it is; :class:`Segments` compiled (and placed) for
    this one call: the path of one-off calls and tests, not of the ring, which compiles once per batch."""
    if not isinstance(call, Segments):
        return call
    arena = Arena()
    program = compile_call(kernel, call, q.size(0), q.size(1), k.size(1), q.device, q.dtype, q.size(-1), arena)
    arena.place(q.device)
    return program
