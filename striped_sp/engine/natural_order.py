"""The whole sequence in its natural order, for a token mixer that is not attention.

A recurrent or convolutional mixer (gated delta net, Mamba scan, short convolution) needs every
token of the sequence in order; under a layout a rank holds only its tokens (every N-th one under
``striped``).  :func:`gather_natural` gives every rank of the group the whole sequence in natural
order (an all-gather, the layout's permutation undone by one index); the mixer runs on it, and
:func:`take_local` keeps this rank's tokens of its output.  Gradients are exact: the gather's
backward sums every rank's gradient for each token and hands each rank its own tokens' sum
(a reduce-scatter; on gloo, which has none, an all-reduce and a slice).

Cost per mixer layer, N ranks, S tokens, C channels: an all-gather of ``S x C`` activations
forward and a reduce-scatter of ``S x C`` gradients backward (``(N - 1) / N`` of it crosses the
network), the mixer's compute and activations for all ``S`` tokens on every rank (N times the
ideal).  The head-split all-to-all that megatron-core's Mamba context parallelism runs would
divide that by N; this is the model-agnostic form, which needs nothing of the mixer's insides.

The permutation is built on the host once per (S, N, layout, rows) and cached, so a layer adds no
host work after the batch's first.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from ..plan.layouts import positions

__all__ = ["NaturalOrder", "natural_order", "gather_natural", "take_local"]


class NaturalOrder:
    """The permutation between a layout's rank-major order and the natural one for one row shape.

    ``bounds``: a packed row's global document boundaries (the placement of a packed row may
    depend on them).  ``rank_major`` ``[S]`` (int64): the global position of the ``i``-th token when every rank's
    tokens are laid one rank after the other; ``to_natural`` ``[S]``: its inverse (the rank-major
    index of position ``p``); ``local`` ``[S / N]``: this rank's positions."""

    def __init__(self, seq_len: int, world_size: int, rank: int, layout: str, bounds=None):
        parts = [positions(seq_len, world_size, r, layout, bounds) for r in range(world_size)]
        self.seq_len, self.world_size, self.rank = seq_len, world_size, rank
        self.rank_major = torch.cat(parts)
        self.to_natural = torch.empty_like(self.rank_major)
        self.to_natural[self.rank_major] = torch.arange(seq_len, dtype=self.rank_major.dtype)
        self.local = parts[rank]
        self._on: dict = {}

    def on(self, device: torch.device) -> "NaturalOrder":
        """The index tensors on ``device`` (copied once per device)."""
        key = str(device)
        if key not in self._on:
            copy = object.__new__(NaturalOrder)
            copy.__dict__.update(self.__dict__)
            for name in ("rank_major", "to_natural", "local"):
                setattr(copy, name, getattr(self, name).to(device))
            copy._on = {key: copy}
            self._on[key] = copy
        return self._on[key]


@functools.lru_cache(maxsize=32)
def natural_order(seq_len: int, world_size: int, rank: int, layout: str, bounds: tuple | None = None) -> NaturalOrder:
    """The cached :class:`NaturalOrder` of a row of ``seq_len`` tokens (``bounds``: a packed row's
    document boundaries as a tuple, ``None`` for one sequence)."""
    return NaturalOrder(seq_len, world_size, rank, layout, bounds)


def _all_gather(x: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """``[b, s, ...]`` of every rank, concatenated on dim 1 in rank order."""
    parts = [torch.empty_like(x) for _ in range(world_size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def _reduce_scatter(x: torch.Tensor, group, world_size: int, rank: int) -> torch.Tensor:
    """``[b, N*s, ...]`` summed over the group; this rank's ``s`` tokens of the sum."""
    s = x.size(1) // world_size
    if dist.get_backend(group) == "nccl":
        chunks = x.movedim(1, 0).reshape(world_size, s, *x.shape[:1], *x.shape[2:]).contiguous()
        out = torch.empty_like(chunks[0])
        dist.reduce_scatter_tensor(out, chunks, group=group)
        return out.movedim(0, 1)
    total = x.contiguous()
    dist.all_reduce(total, group=group)
    return total.narrow(1, rank * s, s)


class _GatherNatural(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, order: NaturalOrder):
        ctx.group, ctx.order = group, order
        return _all_gather(x, group, order.world_size).index_select(1, order.to_natural)

    @staticmethod
    def backward(ctx, grad):
        order = ctx.order
        rank_major = grad.index_select(1, order.rank_major)
        return _reduce_scatter(rank_major, ctx.group, order.world_size, order.rank), None, None


def gather_natural(x: torch.Tensor, group, order: NaturalOrder) -> torch.Tensor:
    """``x`` ``[b, S/N, ...]`` (this rank's tokens in the layout's local order) -> ``[b, S, ...]``,
    the whole sequence in natural order on every rank of ``group``.  Differentiable: the gradient
    of each of this rank's tokens is the sum of every rank's gradient for it."""
    if x.size(1) * order.world_size != order.seq_len:
        raise ValueError(f"gather_natural: {x.size(1)} local tokens x {order.world_size} ranks != "
                         f"the row's {order.seq_len} tokens")
    return _GatherNatural.apply(x, group, order.on(x.device))


def take_local(y: torch.Tensor, order: NaturalOrder) -> torch.Tensor:
    """``y`` ``[b, S, ...]`` in natural order -> this rank's tokens ``[b, S/N, ...]`` (local order)."""
    return y.index_select(1, order.on(y.device).local)
