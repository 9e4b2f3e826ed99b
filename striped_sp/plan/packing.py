"""Packed rows: padding documents for a layout, and RoPE positions inside documents.

A packed row holds many documents back to back; ``cu_seqlens`` ``[0, l1, l1+l2, ..., S]`` marks
their boundaries (the THD convention).  ``striped`` and ``contiguous`` shard any packed row whose
length divides by ``N``; ``zigzag`` follows Transformer Engine and needs every document padded to a
multiple of ``2N`` (each document is cut into ``2N`` chunks).  :func:`pad_documents` computes that
padding (or, for the other layouts, only the tail that makes the row divide by ``N``).
"""

from __future__ import annotations

import dataclasses

import torch

from .layouts import get_layout
from .masks import as_bounds, check_cu_seqlens

__all__ = ["PaddedDocuments", "pad_documents", "document_positions"]


@dataclasses.dataclass(frozen=True)
class PaddedDocuments:
    """A packed row after padding.

    ``cu_seqlens``: int64 boundaries of the padded row (pass these to ``shard`` and
    ``ring_attention``); ``index``: int64 position in the padded row of every original token;
    ``padding_tokens``: how many tokens were added; ``seq_len``: the padded row length."""

    cu_seqlens: torch.Tensor
    index: torch.Tensor
    padding_tokens: int
    seq_len: int
    world_size: int = 1
    layout: str = "striped"

    def pad(self, x: torch.Tensor, dim: int = 1, value=0) -> torch.Tensor:
        """``x`` (original row on ``dim``) laid out on the padded row; padding filled with ``value``
        (use ``value=0`` for a loss mask, any token id for inputs and labels)."""
        if x.size(dim) != self.index.numel():
            raise ValueError(f"x has {x.size(dim)} tokens on dim {dim}; the packed row has {self.index.numel()}")
        shape = list(x.shape)
        shape[dim] = self.seq_len
        out = torch.full(shape, value, dtype=x.dtype, device=x.device)
        return out.index_copy(dim, self.index.to(x.device), x)

    def shard(self, x: torch.Tensor, rank: int, dim: int = 1, value=0) -> torch.Tensor:
        """``rank``'s part of ``x`` (original row on ``dim``): padded, then sharded with the layout
        and the padded boundaries."""
        from .layouts import shard

        return shard(self.pad(x, dim, value), self.world_size, rank, dim, self.layout, self.cu_seqlens)

    def unpad(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The original tokens of ``x`` (padded row on ``dim``)."""
        return x.index_select(dim, self.index.to(x.device))


def pad_documents(cu_seqlens, world_size: int, layout: str = "zigzag") -> PaddedDocuments:
    """Padding of a packed row for ``layout`` on ``world_size`` ranks.

    ``zigzag``: every document padded at its end to a multiple of ``2 * world_size`` (Transformer
    Engine's rule for THD with context parallelism).  The padding belongs to its document, after
    every real token: exact for causal attention (``right = 0``), where no real query sees a later
    position; with ``causal=False`` or a right window real queries would see the padding, so
    zigzag padding is for causal attention only.  ``striped`` / ``contiguous``: documents stay
    as they are; when the row length does not divide by ``world_size`` (times the stripe size of a
    striped layout without document placement), the missing tokens are
    appended as one extra padding document (it attends only to itself), exact in every case."""
    lay = get_layout(layout)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    raw = as_bounds(cu_seqlens)
    bounds = check_cu_seqlens(raw, raw[-1] if raw else 0, world_size)
    seq_len = bounds[-1]
    lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], dtype=torch.int64)
    unit = lay.document_multiple(world_size)
    if unit > 1:
        padded = (lengths + unit - 1) // unit * unit
        starts = torch.cumsum(padded, 0) - padded
        doc = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
        offset = torch.arange(seq_len) - torch.tensor(bounds[:-1], dtype=torch.int64)[doc]
        index = starts[doc] + offset
        new_bounds = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(padded, 0)])
    else:
        tail = -seq_len % (world_size * lay.seq_multiple)  # striped stripes: whole stripes per rank
        index = torch.arange(seq_len)
        new_bounds = torch.tensor(bounds + ((seq_len + tail,) if tail else ()), dtype=torch.int64)
    total = int(new_bounds[-1])
    return PaddedDocuments(new_bounds, index, total - seq_len, total, world_size, lay.key)


def document_positions(seq_len: int, world_size: int, rank: int, layout: str = "striped",
                       cu_seqlens=None, stripe_size: int | None = None, doc_placement=None) -> torch.Tensor:
    """RoPE positions of ``rank``'s tokens on a packed row: ``position - start of its document``
    (int64, in local order).  Without ``cu_seqlens`` these are the global positions."""
    from .layouts import positions

    pos = positions(seq_len, world_size, rank, layout, cu_seqlens, stripe_size, doc_placement)
    if cu_seqlens is None:
        return pos
    bounds = torch.tensor(check_cu_seqlens(cu_seqlens, seq_len, world_size, get_layout(layout)), dtype=torch.int64)
    doc = torch.searchsorted(bounds[1:], pos, right=True)
    return pos - bounds[doc]
