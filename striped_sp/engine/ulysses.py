"""Hierarchical context parallelism: a Ulysses all-to-all over heads inside, the ring across.

The CP group of ``N`` ranks (its ranks in group order ``c_0 .. c_{N-1}``) splits into ``r = N / u``
*inner* groups of ``u`` consecutive ranks (inner group ``g`` = ``c_{g*u} .. c_{g*u+u-1}``, e.g. the
GPUs of one node) and ``u`` *outer* groups (outer group ``i`` = ``c_i, c_{i+u}, c_{i+2u}, ...``).

Data stays sharded as for the 1-D ring: rank ``c_m`` holds ``shard(x, N, m, layout)``.  Inside an
inner group an all-to-all trades heads for tokens: afterwards member ``i`` holds the tokens of the
whole inner group (its members' shards, member after member) for heads slice ``i``.  Those tokens
are one rank of a :class:`~striped_sp.plan.grouped.GroupedLayout` on ``r`` ranks, and the ring runs
over the outer group ``i``: on dense rows the pairs of member blocks on the layout's dense plans,
with documents or windows the masked plans.  ``u = N`` is pure Ulysses (the ring has one rank): the
plan's run order puts the gathered row in natural order, one causal call (one varlen call on
packed rows), and its inverse puts the output and the gradients back (:mod:`striped_sp.engine.run_order`).
The inverse all-to-all gives every rank its own tokens with every head back.  ``u = 1`` is the plain
ring.

Heads: ``heads % u == 0``; kv heads either divide by ``u`` or divide ``u`` (then each kv head is
replicated ``u / kv_heads`` times before the all-to-all, so every member gets the one kv head its
query heads use; the replicas' gradients are summed back).
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist


__all__ = ["ulysses_ring_groups", "check_ulysses", "check_ulysses_groups", "seq_to_heads",
           "heads_to_seq"]


def check_ulysses(u: int, world_size: int, heads: int, kv_heads: int) -> None:
    """``ValueError`` naming the rule unless ``u`` splits ``world_size`` ranks and the heads."""
    if not isinstance(u, int) or isinstance(u, bool) or u < 1:
        raise ValueError(f"ulysses_size={u!r} must be a positive int")
    if world_size % u:
        raise ValueError(f"ulysses_size={u} must divide the context-parallel size {world_size}")
    if heads % u:
        raise ValueError(f"ulysses_size={u} must divide the query heads ({heads}): each member of a "
                         "Ulysses group takes heads / ulysses_size of them")
    if kv_heads % u and u % kv_heads:
        raise ValueError(f"kv heads ({kv_heads}) must divide by ulysses_size={u} or divide it "
                         "(then each kv head is replicated ulysses_size / kv_heads times)")


def check_ulysses_groups(group, groups, ulysses_size: int) -> None:
    """``(inner, outer)`` must be this rank's groups of the documented mapping over ``group``."""
    try:
        inner, outer = groups
    except (TypeError, ValueError):
        raise ValueError("ulysses_groups must be a pair (inner, outer) of process groups") from None
    for name, g in (("inner", inner), ("outer", outer)):
        if g is None and name == "outer":
            continue
        if not isinstance(g, dist.ProcessGroup):
            raise ValueError(f"ulysses_groups: the {name} group is {g!r}, not a process group this rank is "
                             "in (build them with striped_sp.ulysses_ring_groups on every rank)")
    u = inner.size()
    if ulysses_size not in (1, u):
        raise ValueError(f"ulysses_size={ulysses_size} but the inner group has {u} ranks")
    cp = dist.get_process_group_ranks(group)
    m = dist.get_rank(group)
    want_inner = cp[m // u * u:(m // u + 1) * u]
    want_outer = cp[m % u::u]
    got_outer = [cp[m]] if outer is None else dist.get_process_group_ranks(outer)  # None: a ring of one
    if dist.get_process_group_ranks(inner) != want_inner or got_outer != want_outer:
        raise ValueError(
            f"ulysses_groups do not follow the mapping over the CP group: rank {cp[m]} needs inner ranks "
            f"{want_inner} and outer ranks {want_outer}, got {dist.get_process_group_ranks(inner)} and "
            f"{got_outer} (inner groups: u consecutive CP ranks; outer None only when u is the CP size)")


_GROUPS: dict = {}
_GROUPS_LOCK = threading.Lock()


def ulysses_ring_groups(cp_ranks: list[list[int]], u: int, backend=None):
    """Build the inner (Ulysses) and outer (ring) groups of every CP group and return this
    rank's ``(inner, outer)`` (``(None, None)`` if it is in none).

    Collective over the whole default group: every process calls it with the same ``cp_ranks``
    (the global ranks of every CP group, in group order) and ``u``.  Cached per arguments."""
    if not isinstance(u, int) or isinstance(u, bool) or u < 1:
        raise ValueError(f"ulysses_size={u!r} must be a positive int")
    # the default group's identity too: after destroy/init_process_group the old groups are gone
    key = (tuple(tuple(r) for r in cp_ranks), u, id(dist.group.WORLD))
    with _GROUPS_LOCK:
        if key in _GROUPS:
            return _GROUPS[key]
    me = dist.get_rank()
    mine = (None, None)
    for ranks in cp_ranks:
        if len(ranks) % u:
            raise ValueError(f"ulysses_size={u} must divide the context-parallel size {len(ranks)}")
        inner = [dist.new_group(ranks[g * u:(g + 1) * u], backend=backend) for g in range(len(ranks) // u)]
        outer = [dist.new_group(ranks[i::u], backend=backend) for i in range(u)]
        if me in ranks:
            m = ranks.index(me)
            mine = (inner[m // u], outer[m % u])
    with _GROUPS_LOCK:
        _GROUPS[key] = mine
    return mine


def _all_to_all(chunks: torch.Tensor, group) -> torch.Tensor:
    """``chunks`` ``[u, ...]``: chunk ``j`` goes to member ``j``; returns what member ``j`` sent."""
    chunks = chunks.contiguous()
    out = torch.empty_like(chunks)  # after contiguous(): empty_like keeps a view's strides
    dist.all_to_all_single(out, chunks, group=group)
    return out


def _seq_to_heads(x: torch.Tensor, group, u: int) -> torch.Tensor:
    b, s, h, d = x.shape
    chunks = x.reshape(b, s, u, h // u, d).permute(2, 0, 1, 3, 4)  # [u, b, s, h/u, d]
    got = _all_to_all(chunks, group)                                  # got[j]: member j's tokens
    return got.permute(1, 0, 2, 3, 4).reshape(b, u * s, h // u, d)


def _heads_to_seq(x: torch.Tensor, group, u: int) -> torch.Tensor:
    b, us, hu, d = x.shape
    chunks = x.reshape(b, u, us // u, hu, d).permute(1, 0, 2, 3, 4)  # [u, b, s, h/u, d]
    got = _all_to_all(chunks, group)                                  # got[j]: heads slice j
    return got.permute(1, 2, 0, 3, 4).reshape(b, us // u, u * hu, d)


class _AllToAll(torch.autograd.Function):
    """One all-to-all of the pair; its gradient is the other one."""

    @staticmethod
    def forward(ctx, x, group, u, to_heads: bool):
        ctx.group, ctx.u, ctx.to_heads = group, u, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group, u)

    @staticmethod
    def backward(ctx, grad):
        inverse = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return inverse(grad.contiguous(), ctx.group, ctx.u), None, None, None


def seq_to_heads(x: torch.Tensor, group, u: int) -> torch.Tensor:
    """``[b, s, h, d]`` (this rank's tokens, every head) -> ``[b, u*s, h/u, d]`` (the inner
    group's tokens, member after member, this member's heads slice).  Differentiable."""
    return _AllToAll.apply(x, group, u, True)


def heads_to_seq(x: torch.Tensor, group, u: int) -> torch.Tensor:
    """The inverse of :func:`seq_to_heads`.  Differentiable."""
    return _AllToAll.apply(x, group, u, False)
