"""Token layouts: which global tokens a rank holds, and the kernel calls of each ring block.

A layout is pure data and arithmetic; it never touches a process group.  For the ring, a
layout answers one question: when the queries of rank ``i`` meet the keys/values of rank
``j``, which kernel calls cover exactly the causal part of that block?  The answer is a
list of :class:`BlockCall`, each a query slice, a key slice and a causal flag, on *local*
indices.  Causal calls are always square, so top-left and bottom-right mask alignment agree
(the CPU kernel aligns top-left, flash-attn 2 bottom-right).

Layouts (sequence of ``S`` tokens on ``N`` ranks, ``n = S / N`` tokens per rank):

* ``contiguous``: rank ``r`` holds ``r*n ... (r+1)*n - 1`` (original Ring Attention).
* ``zigzag``: the sequence is cut into ``2N`` chunks; rank ``r`` holds chunks ``r`` and
  ``2N-1-r`` (Megatron-LM / Transformer Engine's load-balanced layout).
* ``striped``: rank ``r`` holds ``r, r+N, r+2N, ...`` (Striped Attention, arXiv 2311.09431).

With packed documents (``cu_seqlens``) ``striped`` and ``contiguous`` keep their positions, while
``zigzag`` follows Transformer Engine's THD rule: every document (padded to a multiple of ``2N``)
is cut into ``2N`` chunks and rank ``r`` holds chunks ``r`` and ``2N-1-r`` of each.  Every layout
describes its tokens as *runs* (local start, first position, count) with one stride, from which
both the positions and the masked block plans (:mod:`striped_sp.masks`) derive.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

__all__ = [
    "BlockCall",
    "Layout",
    "LAYOUTS",
    "get_layout",
    "positions",
    "shard",
    "unshard",
]


@dataclasses.dataclass(frozen=True)
class BlockCall:
    """One attention kernel call inside a ring block, on local token indices.

    ``q`` slices the local queries, ``kv`` the visiting keys/values; ``causal`` says whether
    the call uses the (square, diagonal-kept) causal mask or attends to every key.  ``strict``
    marks the striped strict block ``q[1:]`` x ``k[:-1]`` (keys strictly before the queries), which
    kernels with a bottom-right causal mask may run as all queries x ``k[:-1]``
    (:mod:`striped_sp.step`).
    """

    q: slice
    kv: slice
    causal: bool
    strict: bool = False

    def q_len(self, n: int) -> int:
        return len(range(*self.q.indices(n)))

    def kv_len(self, n: int) -> int:
        return len(range(*self.kv.indices(n)))

    def score_entries(self, n: int) -> int:
        """Attention score entries this call computes per (batch, head), for ``n`` local tokens."""
        lq, lk = self.q_len(n), self.kv_len(n)
        if self.causal:
            return lq * (lq + 1) // 2
        return lq * lk


_ALL = slice(None)


class Layout:
    """Base class of a token layout.  Subclasses define ``name``, :meth:`positions` and
    :meth:`causal_plan`; everything else derives from those."""

    name: str = ""
    #: the sequence length must be a multiple of ``world_size * seq_multiple``
    seq_multiple: int = 1

    @property
    def key(self) -> str:
        """The layout and its parameters as one string (equal keys: the same token placement),
        for caches and the cross-rank agreement check."""
        return self.name

    def check_seq_len(self, seq_len: int, world_size: int) -> None:
        """Raise ``ValueError`` unless ``seq_len`` splits evenly over ``world_size`` ranks."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        unit = world_size * self.seq_multiple
        if seq_len <= 0 or seq_len % unit != 0:
            rule = f"{self.seq_multiple} * world_size" if self.seq_multiple > 1 else "world_size"
            raise ValueError(
                f"sequence length {seq_len} must be a positive multiple of {rule} = {unit} "
                f"for layout '{self.name}' (world_size={world_size})"
            )

    def check_local_len(self, local_len: int) -> None:
        """Raise ``ValueError`` unless ``local_len`` tokens per rank fit this layout."""
        if local_len <= 0 or local_len % self.seq_multiple != 0:
            raise ValueError(
                f"local sequence length {local_len} must be a positive multiple of "
                f"{self.seq_multiple} for layout '{self.name}'"
            )

    def stride(self, world_size: int) -> int:
        """Position step between consecutive local tokens inside one run."""
        return 1

    def runs(self, seq_len: int, world_size: int, rank: int, cu_seqlens=None):
        """This rank's tokens as runs ``(local_start, first_position, count)`` of step
        :meth:`stride`, in local order (positions increase along the local index): a list of
        triples or an int64 tensor ``[runs, 3]``."""
        raise NotImplementedError

    def positions(self, seq_len: int, world_size: int, rank: int, cu_seqlens=None) -> torch.Tensor:
        """Global positions (int64, increasing, length ``seq_len // world_size``) of rank's tokens.

        ``cu_seqlens`` (document boundaries of the packed row, a list of ints) changes the
        positions of ``zigzag`` only."""
        self.check_seq_len(seq_len, world_size)
        runs = torch.as_tensor(self.runs(seq_len, world_size, rank, cu_seqlens), dtype=torch.int64).view(-1, 3)
        count = runs[:, 2]
        run = torch.repeat_interleave(torch.arange(runs.size(0)), count)
        offset = torch.arange(run.numel()) - (torch.cumsum(count, 0) - count)[run]
        return runs[run, 1] + self.stride(world_size) * offset

    def causal_plan(self, rank: int, source: int, world_size: int, local_len: int) -> list[BlockCall]:
        raise NotImplementedError

    def plan(
        self, rank: int, source: int, world_size: int, local_len: int, causal: bool = True
    ) -> list[BlockCall]:
        """Kernel calls for the queries of ``rank`` against the keys/values of ``source``.

        Fully masked blocks give an empty list.  Without ``causal`` every block is one full call.
        """
        if not causal:
            return [BlockCall(_ALL, _ALL, False)]
        return self.causal_plan(rank, source, world_size, local_len)


class Contiguous(Layout):
    name = "contiguous"

    def runs(self, seq_len, world_size, rank, cu_seqlens=None):
        n = seq_len // world_size
        return [(0, rank * n, n)]

    def causal_plan(self, rank, source, world_size, local_len):
        if source == rank:
            return [BlockCall(_ALL, _ALL, True)]
        if source < rank:
            return [BlockCall(_ALL, _ALL, False)]
        return []


class Zigzag(Layout):
    name = "zigzag"
    seq_multiple = 2

    def runs(self, seq_len, world_size, rank, cu_seqlens=None):
        # two runs per document (its chunks rank and 2N-1-rank), vectorised: rows can pack thousands
        bounds = torch.tensor([0, seq_len] if cu_seqlens is None else list(cu_seqlens), dtype=torch.int64)
        start = bounds[:-1]
        c = (bounds[1:] - start) // (2 * world_size)
        local = torch.cumsum(2 * c, 0) - 2 * c
        first = torch.stack([local, start + rank * c, c], 1)
        second = torch.stack([local + c, start + (2 * world_size - 1 - rank) * c, c], 1)
        return torch.stack([first, second], 1).reshape(-1, 3)

    def causal_plan(self, rank, source, world_size, local_len):
        half = local_len // 2
        if source == rank:
            # Local indices are increasing positions, so the local causal mask is the global one.
            return [BlockCall(_ALL, _ALL, True)]
        if source < rank:
            # Both query chunks see the source's early chunk whole and none of its late chunk.
            return [BlockCall(_ALL, slice(0, half), False)]
        # source > rank: only the late query chunk sees anything, and it sees both key chunks.
        return [BlockCall(slice(half, None), _ALL, False)]


class Striped(Layout):
    name = "striped"

    def stride(self, world_size):
        return world_size

    def runs(self, seq_len, world_size, rank, cu_seqlens=None):
        return [(0, rank, seq_len // world_size)]

    def causal_plan(self, rank, source, world_size, local_len):
        # Key b of `source` sits at b*N + source, query a of `rank` at a*N + rank.
        if source <= rank:
            return [BlockCall(_ALL, _ALL, True)]  # b <= a
        if local_len == 1:
            return []
        # b < a: the causal kernel on q[1:] against k[:-1] (never a mask: a fully masked row
        # would come back from fused kernels with lse = 0 instead of -inf).
        return [BlockCall(slice(1, None), slice(0, local_len - 1), True, strict=True)]


LAYOUTS: dict[str, Layout] = {cls.name: cls() for cls in (Striped, Zigzag, Contiguous)}


def get_layout(layout: str | Layout) -> Layout:
    """The :class:`Layout` named ``layout`` (or ``layout`` itself); ``ValueError`` if unknown."""
    if isinstance(layout, Layout):
        return layout
    try:
        return LAYOUTS[layout]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown layout {layout!r}: expected one of {sorted(LAYOUTS)}"
        ) from None


def _check_rank(world_size: int, rank: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must satisfy 0 <= rank < world_size={world_size}")


def positions(seq_len: int, world_size: int, rank: int, layout: str = "striped", cu_seqlens=None) -> torch.Tensor:
    """Global positions (int64, increasing) of the tokens that ``rank`` holds under ``layout``.

    ``cu_seqlens``: document boundaries of a packed row (see :func:`striped_sp.ring_attention`);
    it changes only ``zigzag`` (per-document chunks, every document a multiple of ``2N`` long)."""
    from .masks import check_cu_seqlens

    lay = get_layout(layout)
    _check_rank(world_size, rank)
    bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seq_len, world_size, lay)
    return lay.positions(seq_len, world_size, rank, bounds)


def shard(x: torch.Tensor, world_size: int, rank: int, dim: int = 1, layout: str = "striped",
          cu_seqlens=None) -> torch.Tensor:
    """The part of ``x`` that ``rank`` holds: ``x.index_select(dim, positions(...))``."""
    idx = positions(x.size(dim), world_size, rank, layout, cu_seqlens).to(x.device)
    return x.index_select(dim, idx)


def unshard(shards: Sequence[torch.Tensor], dim: int = 1, layout: str = "striped", cu_seqlens=None) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (the inverse of :func:`shard`)."""
    if len(shards) == 0:
        raise ValueError("unshard needs at least one shard, got an empty list")
    lay = get_layout(layout)
    world_size = len(shards)
    local = shards[0].size(dim)
    for r, s in enumerate(shards):
        if s.size(dim) != local:
            raise ValueError(
                f"shard {r} has {s.size(dim)} tokens on dim {dim}, shard 0 has {local}: all must be equal"
            )
    seq_len = local * world_size
    stacked = torch.cat(list(shards), dim=dim)
    order = torch.cat([positions(seq_len, world_size, r, lay, cu_seqlens) for r in range(world_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len, dtype=order.dtype)
    return stacked.index_select(dim, inverse.to(stacked.device))
