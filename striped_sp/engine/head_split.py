"""Sequence split <-> head (channel) split, in natural order, for a token mixer that is not attention.

A recurrent or convolutional mixer (gated delta net, Mamba scan, short convolution) needs every
token of the sequence in order, but it mixes no heads (or channels) between its per-token input
projections and its output projection.  So instead of gathering the whole sequence on every rank
(:mod:`.natural_order`), one all-to-all trades the layout's sequence split for a head split:

* :func:`tokens_to_heads`: ``x`` ``[b, S/N, N, c]`` (this rank's tokens in the layout's local
  order; ``x[:, :, j]`` is what rank ``j`` will own: its heads' channels, ``c`` per rank) ->
  ``[b, S, c]``: every token of the row in natural order, this rank's ``c`` channels;
* :func:`heads_to_tokens`: its inverse, ``[b, S, c]`` -> ``[b, S/N, N, c]`` (``[:, :, j]``: rank
  ``j``'s channels of this rank's tokens).

Each is the other's gradient (the pair is exact in backward too).  The layout's permutation is
folded into one ``index_select`` on the received rows (:class:`~.natural_order.NaturalOrder`, built
on the host once per row shape and cached), so a layer adds no host work after the batch's first.
Channels that several ranks need (a key head shared by the value heads of two ranks, Mamba2's B/C
groups when the groups do not split) are simply put in several ranks' slices by the caller; the
autograd of that expand sums their gradients back.

Cost per call, ``S`` tokens, ``C = N * c`` channels: one all-to-all of ``S/N x C`` elements per rank,
``(N - 1) / N`` of it crossing the network, against the gather's ``S x C`` per rank and the mixer's
compute on all ``S`` tokens on every rank.  The mixer then runs on ``S x C / N`` per rank.
"""

from __future__ import annotations

import torch

from .natural_order import NaturalOrder
from .ulysses import _all_to_all as _exchange  # chunk j to rank j; what rank j sent (tests count its calls)

__all__ = ["tokens_to_heads", "heads_to_tokens"]


def _to_heads(x: torch.Tensor, group, order: NaturalOrder) -> torch.Tensor:
    b, s, n, c = x.shape
    got = _exchange(x.permute(2, 0, 1, 3), group)          # got[i]: rank i's tokens, my channels
    rank_major = got.permute(1, 0, 2, 3).reshape(b, n * s, c)
    return rank_major.index_select(1, order.to_natural)


def _to_tokens(y: torch.Tensor, group, order: NaturalOrder) -> torch.Tensor:
    b, total, c = y.shape
    n = order.world_size
    rank_major = y.index_select(1, order.rank_major).reshape(b, n, total // n, c)
    got = _exchange(rank_major.permute(1, 0, 2, 3), group)  # got[j]: rank j's channels, my tokens
    return got.permute(1, 2, 0, 3)


class _Relayout(torch.autograd.Function):
    """One of the pair; its gradient is the other one."""

    @staticmethod
    def forward(ctx, x, group, order, to_heads: bool):
        ctx.group, ctx.order, ctx.to_heads = group, order, to_heads
        return (_to_heads if to_heads else _to_tokens)(x, group, order)

    @staticmethod
    def backward(ctx, grad):
        return (_to_tokens if ctx.to_heads else _to_heads)(grad, ctx.group, ctx.order), None, None, None


def _check(what: str, got: int, order: NaturalOrder, expected: int) -> None:
    if got != expected:
        raise ValueError(f"{what}: {got} does not match the row's order ({order.seq_len} tokens on "
                         f"{order.world_size} ranks: {expected})")


def tokens_to_heads(x: torch.Tensor, group, order: NaturalOrder) -> torch.Tensor:
    """``x`` ``[b, S/N, N, c]`` (any float dtype; this rank's tokens, ``x[:, :, j]`` for rank ``j``)
    -> ``[b, S, c]`` in natural order: rank ``i``'s slice ``i`` of every token.  Differentiable."""
    if x.dim() != 4:
        raise ValueError(f"tokens_to_heads: x must be [batch, local tokens, ranks, channels], got {tuple(x.shape)}")
    _check("tokens_to_heads: local tokens x ranks", x.size(1) * order.world_size, order, order.seq_len)
    _check("tokens_to_heads: the rank dimension", x.size(2), order, order.world_size)
    return _Relayout.apply(x, group, order.on(x.device), True)


def heads_to_tokens(y: torch.Tensor, group, order: NaturalOrder) -> torch.Tensor:
    """``y`` ``[b, S, c]`` (natural order, this rank's channels) -> ``[b, S/N, N, c]``: this rank's
    tokens in the layout's local order, ``[:, :, j]`` the channels rank ``j`` held.  Differentiable."""
    if y.dim() != 3:
        raise ValueError(f"heads_to_tokens: y must be [batch, tokens, channels], got {tuple(y.shape)}")
    _check("heads_to_tokens: tokens", y.size(1), order, order.seq_len)
    return _Relayout.apply(y, group, order.on(y.device), False)
