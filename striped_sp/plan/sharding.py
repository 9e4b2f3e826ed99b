"""A tensor's tokens by rank: :func:`positions` (the global positions a rank holds under a layout),
:func:`shard` (the part of a tensor a rank holds) and :func:`unshard` (every rank's shard back into the
full tensor), with the checks of their arguments.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .layout_registry import get_layout

__all__ = ["positions", "shard", "unshard"]


def _check_rank(world_size: int, rank: int) -> None:
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must satisfy 0 <= rank < world_size={world_size}")


def positions(seq_len: int, world_size: int, rank: int, layout: str = "striped", cu_seqlens=None,
              stripe_size: int | None = None, doc_placement=None) -> torch.Tensor:
    """Global positions (int64) of the tokens that ``rank`` holds under ``layout``, in local order
    (increasing unless whole documents are placed).

    ``cu_seqlens``: document boundaries of a packed row (see :func:`striped_sp.ring_attention`);
    it changes ``zigzag`` (per-document chunks, every document a multiple of ``2N`` long) and a
    striped layout with ``doc_placement``.  ``stripe_size`` / ``doc_placement``: see
    :class:`~striped_sp.plan.striped_layout.Striped`."""
    from .masks import check_cu_seqlens

    lay = get_layout(layout, stripe_size, doc_placement)
    _check_rank(world_size, rank)
    bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seq_len, world_size, lay)
    return lay.positions(seq_len, world_size, rank, bounds)


def _check_dim(what: str, name: str, x, dim) -> int:
    """``dim`` of tensor ``x`` as a non-negative index (``TypeError`` / ``ValueError`` naming both)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{what}: dim={dim!r} is not a dim of {name} of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard(x: torch.Tensor, world_size: int, rank: int, dim: int = 1, layout: str = "striped",
          cu_seqlens=None, stripe_size: int | None = None, doc_placement=None) -> torch.Tensor:
    """The part of ``x`` that ``rank`` holds: ``x.index_select(dim, positions(...))``.

    A packed row whose placement depends on its documents (the default ``striped``, ``zigzag``) must
    be sharded with its ``cu_seqlens``: this call notes that it was, and ``ring_attention(...,
    cu_seqlens=)`` refuses a row no such call sharded (:mod:`striped_sp.plan.sharded_rows`)."""
    dim = _check_dim("shard", "x", x, dim)
    lay = get_layout(layout, stripe_size, doc_placement)
    idx = positions(x.size(dim), world_size, rank, lay, cu_seqlens).to(x.device)
    if cu_seqlens is not None:
        from .sharded_rows import record_sharded

        record_sharded(lay, world_size, cu_seqlens)
    return x.index_select(dim, idx)


def unshard(shards: Sequence[torch.Tensor], dim: int = 1, layout: str = "striped", cu_seqlens=None,
            stripe_size: int | None = None, doc_placement=None) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (the inverse of :func:`shard`)."""
    if isinstance(shards, torch.Tensor) or not isinstance(shards, Sequence):
        raise TypeError(f"unshard takes a list of every rank's shard (tensors), got {type(shards).__name__}")
    if len(shards) == 0:
        raise ValueError("unshard needs at least one shard, got an empty list")
    lay = get_layout(layout, stripe_size, doc_placement)
    world_size = len(shards)
    dim = _check_dim("unshard", "shard 0", shards[0], dim)
    local = shards[0].size(dim)
    for r, s in enumerate(shards):
        _check_dim("unshard", f"shard {r}", s, dim)
        if s.size(dim) != local:
            raise ValueError(
                f"shard {r} has {s.size(dim)} tokens on dim {dim}, shard 0 has {local}: all must be equal"
            )
        if s.shape != shards[0].shape or s.dtype != shards[0].dtype or s.device != shards[0].device:
            raise ValueError(f"shard {r} is {tuple(s.shape)} {s.dtype} on {s.device}, shard 0 is "
                             f"{tuple(shards[0].shape)} {shards[0].dtype} on {shards[0].device}: all must match")
    seq_len = local * world_size
    stacked = torch.cat(list(shards), dim=dim)
    order = torch.cat([positions(seq_len, world_size, r, lay, cu_seqlens) for r in range(world_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len, dtype=order.dtype)
    return stacked.index_select(dim, inverse.to(stacked.device))
