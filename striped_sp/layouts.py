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
    the call uses the (square, diagonal-kept) causal mask or attends to every key.
    """

    q: slice
    kv: slice
    causal: bool

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

    def positions(self, seq_len: int, world_size: int, rank: int) -> torch.Tensor:
        """Global positions (int64, increasing, length ``seq_len // world_size``) of rank's tokens."""
        raise NotImplementedError

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

    def positions(self, seq_len, world_size, rank):
        self.check_seq_len(seq_len, world_size)
        n = seq_len // world_size
        return torch.arange(rank * n, (rank + 1) * n, dtype=torch.int64)

    def causal_plan(self, rank, source, world_size, local_len):
        if source == rank:
            return [BlockCall(_ALL, _ALL, True)]
        if source < rank:
            return [BlockCall(_ALL, _ALL, False)]
        return []


class Zigzag(Layout):
    name = "zigzag"
    seq_multiple = 2

    def positions(self, seq_len, world_size, rank):
        self.check_seq_len(seq_len, world_size)
        c = seq_len // (2 * world_size)
        first = torch.arange(rank * c, (rank + 1) * c, dtype=torch.int64)
        last_chunk = 2 * world_size - 1 - rank
        second = torch.arange(last_chunk * c, (last_chunk + 1) * c, dtype=torch.int64)
        return torch.cat([first, second])

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

    def positions(self, seq_len, world_size, rank):
        self.check_seq_len(seq_len, world_size)
        return torch.arange(rank, seq_len, world_size, dtype=torch.int64)

    def causal_plan(self, rank, source, world_size, local_len):
        # Key b of `source` sits at b*N + source, query a of `rank` at a*N + rank.
        if source <= rank:
            return [BlockCall(_ALL, _ALL, True)]  # b <= a
        if local_len == 1:
            return []
        # b < a: the causal kernel on q[1:] against k[:-1] (never a mask: a fully masked row
        # would come back from fused kernels with lse = 0 instead of -inf).
        return [BlockCall(slice(1, None), slice(0, local_len - 1), True)]


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


def positions(seq_len: int, world_size: int, rank: int, layout: str = "striped") -> torch.Tensor:
    """Global positions (int64, increasing) of the tokens that ``rank`` holds under ``layout``."""
    lay = get_layout(layout)
    _check_rank(world_size, rank)
    return lay.positions(seq_len, world_size, rank)


def shard(x: torch.Tensor, world_size: int, rank: int, dim: int = 1, layout: str = "striped") -> torch.Tensor:
    """The part of ``x`` that ``rank`` holds: ``x.index_select(dim, positions(...))``."""
    idx = positions(x.size(dim), world_size, rank, layout).to(x.device)
    return x.index_select(dim, idx)


def unshard(shards: Sequence[torch.Tensor], dim: int = 1, layout: str = "striped") -> torch.Tensor:
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
    order = torch.cat([lay.positions(seq_len, world_size, r) for r in range(world_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len, dtype=order.dtype)
    return stacked.index_select(dim, inverse.to(stacked.device))
