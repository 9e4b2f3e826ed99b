"""All ``N`` ranks of a ring in one process: the engine's own executor on a
:class:`~striped_sp.engine.transport.LocalRing`.

:func:`simulate` shards full-sequence ``q``/``k``/``v`` as ``N`` ranks would, builds every rank's
:class:`~striped_sp.plan.ring_plan.RingPlan` exactly as :class:`~striped_sp.engine.request.RingRequest`
does, runs the ranks' forward (and, given ``dout``, backward) generators side by side and returns the
unsharded results.  It is what the large-N tests check against float64, what ``striped-sp bench sim``
times (``clock``), and, on meta tensors, the dry run of the CUDA path.

Hierarchical CP (``ulysses_size = u``): the all-to-all over heads is done here by indexing (member
``i`` of each Ulysses group takes head slice ``i`` of the group's tokens); the ``u`` outer rings of
``N / u`` ranks then run the engine's grouped plans.
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels import accumulator_dtype, resolve_kernel
from ..kernels.merge import sink_grad
from ..plan.grouped import GroupedLayout
from ..plan.layouts import shard, unshard
from ..plan.ring_plan import RingPlan, build_ring_plan
from .autograd import backward_steps, forward_steps
from .request import RingRequest, _equal_head_dims, check_sinks, ulysses_heads
from .transport import LocalRing, run_local

__all__ = ["simulate", "local_plans", "Simulation"]


@dataclasses.dataclass
class Simulation:
    """Full-sequence results of a simulated ring: ``out`` ``[b, S, h, dv]``; ``dq``/``dk``/``dv``
    (``None`` without ``dout``); ``plans[i][r]``: rank ``r``'s plan on outer ring ``i``; ``ring``:
    the :class:`LocalRing` of each outer ring (its ``sent_bytes``); ``dsinks`` ``[h]``: the sinks'
    gradient summed over the ranks, in ``sinks.dtype`` (``None`` without ``sinks`` or ``dout``)."""

    out: torch.Tensor
    dq: torch.Tensor | None
    dk: torch.Tensor | None
    dv: torch.Tensor | None
    plans: list
    rings: list
    dsinks: torch.Tensor | None = None


def local_plans(request: RingRequest, world_size: int, local_len: int, *, device, dtype, head_dim: int,
                scale: float, batch: int = 1, kernel=None, heads: int = 1, strict_block: str | None = None,
                comm_dtype: torch.dtype | None = None) -> list[RingPlan]:
    """Every rank's plan of a ring of ``world_size`` for ``request`` (its layout, or its grouped
    layout under Ulysses, where ``world_size`` is the outer ring's and ``local_len`` a member's
    gathered tokens).  ``strict_block`` / ``comm_dtype``: the call's, as
    :class:`~striped_sp.engine.request.RingRequest` resolves them (default: the sliced strict block,
    the request's ``grad_comm_dtype`` or the accumulator dtype)."""
    u = request.ulysses_size
    n_all = world_size * u
    kernel = (kernel or resolve_kernel(request.backend, device, dtype, head_dim, deterministic=request.deterministic,
                                       softcap=request.softcap)).with_softcap(request.softcap)
    mask = request._mask(local_len // u, n_all)
    layout = GroupedLayout(request.layout, u) if request.hierarchical else request.layout
    comm = comm_dtype or request.grad_comm_dtype or (torch.float64 if dtype == torch.float64 else torch.float32)
    return [build_ring_plan(layout, mask, request.causal, world_size, r, local_len, kernel=kernel, scale=scale,
                            comm_dtype=comm, strict_block=strict_block or "sliced", device=device, dtype=dtype, head_dim=head_dim, batch=batch, heads=heads)
            for r in range(world_size)]


def simulate(q, k, v, world_size: int, dout=None, *, clock=None, copy: bool = True, kernel=None, plans=None,
             sinks=None, **request_args) -> Simulation:
    """Ring attention of full-sequence ``q`` ``[b, S, h, d]``, ``k``/``v`` ``[b, S, kv_heads, d]``
    on ``world_size`` simulated ranks; ``request_args`` as :class:`RingRequest` (``layout``,
    ``causal``, ``cu_seqlens``, ``window_size``, ``ulysses_size``, ``backend``, ...); ``sinks``
    ``[h]`` as :func:`~striped_sp.engine.request.ring_attention`'s (each rank's gradient is summed
    into ``Simulation.dsinks``).  ``clock(ring,
    rank, round, seconds)``: the host time of each rank's compute per round.  ``plans``: the
    ``Simulation.plans`` of an earlier call with the same arguments, run again (a later layer of the
    same batch: nothing is planned or placed).  On ``meta`` tensors nothing is computed: a dry run
    of the device path (shards and results are empty tensors of the right shapes)."""
    request = RingRequest(None, **request_args)
    n, u = _check_full(q, k, v, dout, world_size, request), request.ulysses_size
    # every check of ring_attention, on rank 0's shapes (views: nothing copied); the same kernel,
    # scale, grad_comm_dtype and strict block form as the ring would run
    call = request._prepare(*(t[:, :t.size(1) // n] for t in (q, k, v)), None, world_size=n, kernel=kernel)
    check_sinks(sinks, q)
    kernel = call.kernel
    cu = request.bounds
    dsinks = None if sinks is None or dout is None else torch.zeros(
        sinks.shape, dtype=accumulator_dtype(q.dtype), device=sinks.device)
    shards = [[_shard(t, n, r, request.layout, cu) for r in range(n)] for t in (q, k, v)]
    if dout is not None:
        shards.append([_shard(dout, n, r, request.layout, cu) for r in range(n)])
    value_dim = v.size(-1)
    outs, grads = [None] * n, [[None] * n for _ in range(3)]
    built, rings = [], []
    for i in range(u):  # outer ring i: member i of every Ulysses group
        members = [[_gather(part, g, i, u, what) for g in range(n // u)]
                   for part, what in zip(shards, ("q", "kv", "kv", "q"))]
        padded = [_equal_head_dims(a, b, c, kernel) for a, b, c in zip(*members[:3])]
        d_out = padded[0][2].size(-1)  # dout's head dim: v's as the kernel takes it (padded or native)
        plan_i = plans[i] if plans is not None else local_plans(
            request, n // u, members[0][0].size(1), device=q.device, dtype=q.dtype,
            head_dim=max(q.size(-1), value_dim), scale=call.scale, batch=q.size(0), kernel=kernel,
            heads=members[0][0].size(2), strict_block=call.strict_block, comm_dtype=call.comm)
        ring = LocalRing(n // u, copy=copy)
        tick = None if clock is None else (lambda r, t, s, i=i: clock(i, r, t, s))
        sinks_i = None if sinks is None else ulysses_heads(sinks, i, u)
        fwd = run_local([forward_steps(*padded[r], plan_i[r], ring.transports[r], sinks_i) for r in range(n // u)],
                        tick)
        bwd = None
        if dout is not None:
            do = [_pad_like(t, d_out) for t in members[3]]
            bwd = run_local([backward_steps(do[r], *padded[r], fwd[r][0], fwd[r][1], plan_i[r], ring.transports[r])
                             for r in range(n // u)], tick)
            if dsinks is not None:
                for r in range(n // u):
                    ulysses_heads(dsinks, i, u).add_(sink_grad(do[r], fwd[r][0], fwd[r][1], sinks_i))
        for g in range(n // u):
            _scatter(outs, fwd[g][0][..., :value_dim], g, i, u, "q")
            if bwd is not None:
                dq, dk, dv = bwd[g]
                _scatter(grads[0], dq[..., :q.size(-1)], g, i, u, "q")
                _scatter(grads[1], dk[..., :k.size(-1)], g, i, u, "kv", k.size(2))
                _scatter(grads[2], dv[..., :value_dim], g, i, u, "kv", k.size(2))
        built.append(plan_i)
        rings.append(ring)
    full = [None if parts[0] is None else _unshard(parts, request.layout, cu) for parts in [outs, *grads]]
    return Simulation(full[0], full[1], full[2], full[3], built, rings,
                      None if dsinks is None else dsinks.to(sinks.dtype))


def _check_full(q, k, v, dout, world_size, request: RingRequest) -> int:
    """``world_size`` once the full-sequence inputs fit it (``TypeError`` / ``ValueError`` naming the
    argument): the rules of :func:`~striped_sp.engine.request.ring_attention` that concern the whole
    row; the per-rank ones follow on rank 0's shapes."""
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise TypeError(f"world_size={world_size!r} must be an int, got {type(world_size).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    named = [("q", q), ("k", k), ("v", v)] + ([] if dout is None else [("dout", dout)])
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: expected 4 dims [batch, seq, heads, head_dim] "
                             "(the full sequence)")
    if q.size(1) != k.size(1):
        raise ValueError(f"sequence lengths differ: q has {q.size(1)}, k and v have {k.size(1)}")
    request.layout.check_seq_len(q.size(1), world_size)
    if dout is not None:
        want = (*q.shape[:3], v.size(-1))
        if tuple(dout.shape) != want or dout.dtype != q.dtype or dout.device != q.device:
            raise ValueError(f"dout is {tuple(dout.shape)} {dout.dtype} on {dout.device}: expected the output's "
                             f"{want} {q.dtype} on {q.device} ([batch, seq, heads, v_head_dim])")
    return world_size


def _shard(x: torch.Tensor, n: int, rank: int, layout, cu) -> torch.Tensor:
    if x.device.type == "meta":
        return x.new_empty(x.size(0), x.size(1) // n, *x.shape[2:])
    return shard(x, n, rank, layout=layout, cu_seqlens=cu)


def _unshard(parts: list, layout, cu) -> torch.Tensor:
    if parts[0].device.type == "meta":
        return parts[0].new_empty(parts[0].size(0), parts[0].size(1) * len(parts), *parts[0].shape[2:])
    return unshard(parts, layout=layout, cu_seqlens=cu)


def _heads(t: torch.Tensor, i: int, u: int, kind: str) -> torch.Tensor:
    h = t.size(2)
    if kind == "kv" and h < u:  # one kv head per member: replicated
        return t[:, :, (i * h) // u:(i * h) // u + 1]
    return t[:, :, i * (h // u):(i + 1) * (h // u)]


def _gather(shards, g: int, i: int, u: int, kind: str) -> torch.Tensor:
    """Member ``i`` of Ulysses group ``g`` after the all-to-all: the group's tokens, head slice ``i``."""
    return torch.cat([_heads(shards[g * u + j], i, u, kind) for j in range(u)], 1)


def _scatter(parts: list, x: torch.Tensor, g: int, i: int, u: int, kind: str, heads: int | None = None) -> None:
    """The inverse of :func:`_gather`: ``x`` back into the shards of group ``g`` (gradients of
    replicated kv heads add up)."""
    local = x.size(1) // u
    for j in range(u):
        piece = x[:, j * local:(j + 1) * local]
        r = g * u + j
        h_all = heads if heads is not None else piece.size(2) * u
        if parts[r] is None:
            parts[r] = piece.new_zeros(piece.size(0), local, h_all, piece.size(3))
        if kind == "kv" and h_all < u:
            parts[r][:, :, (i * h_all) // u:(i * h_all) // u + 1] += piece
        else:
            w = h_all // u
            parts[r][:, :, i * w:(i + 1) * w] += piece


def _pad_like(t: torch.Tensor, d: int) -> torch.Tensor:
    return t if t.size(-1) == d else torch.nn.functional.pad(t, (0, d - t.size(-1)))
