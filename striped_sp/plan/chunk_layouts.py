"""The layouts that deal each rank contiguous chunks of the row: ``contiguous`` (rank ``r`` holds
``r*n .. (r+1)*n - 1``, original Ring Attention) and ``zigzag`` (chunks ``r`` and ``2N-1-r`` of ``2N``,
per document on packed rows: Megatron-LM / Transformer Engine's load-balanced layout).
"""

from __future__ import annotations

import torch

from .layout_base import _ALL, BlockCall, Layout

__all__ = ["Contiguous", "Zigzag"]


class Contiguous(Layout):
    name = "contiguous"

    def window_block(self, world_size, local_len, mask=None):
        return local_len

    def runs(self, seq_len, world_size, rank, cu_seqlens=None):
        n = seq_len // world_size
        return [(0, rank * n, n)]

    def causal_plan(self, rank, source, world_size, local_len):
        if source == rank:
            return [BlockCall(_ALL, _ALL, True)]
        if source < rank:
            return [BlockCall(_ALL, _ALL, False)]
        return []

    contiguous_slices = True  # see Layout.contiguous_slices


class Zigzag(Layout):
    name = "zigzag"
    seq_multiple = 2
    places_documents = True

    def document_multiple(self, world_size):
        return 2 * world_size  # Transformer Engine's THD rule: each document in 2N chunks

    def runs(self, seq_len, world_size, rank, cu_seqlens=None):
        return self._runs(seq_len, world_size, torch.tensor([rank]), cu_seqlens)[0]

    def all_run_tables(self, seq_len, world_size, cu_seqlens=None):
        runs = self._runs(seq_len, world_size, torch.arange(world_size), cu_seqlens)  # [N, 2 * docs, 3]
        steps = torch.ones(world_size, runs.size(1), 1, dtype=torch.int64)
        return torch.cat([runs, steps], 2).view(-1, 4), torch.full((world_size,), runs.size(1), dtype=torch.int64)

    @staticmethod
    def _runs(seq_len, world_size, ranks, cu_seqlens):
        """``[ranks, 2 * docs, 3]``: two runs per document (its chunks rank and 2N-1-rank), vectorised
        over documents and ranks: rows can pack thousands."""
        bounds = torch.tensor([0, seq_len] if cu_seqlens is None else list(cu_seqlens), dtype=torch.int64)
        start = bounds[:-1]
        c = (bounds[1:] - start) // (2 * world_size)
        local = (torch.cumsum(2 * c, 0) - 2 * c).expand(ranks.numel(), -1)
        r = ranks[:, None]
        first = torch.stack([local, start + r * c, c.expand_as(local)], 2)
        second = torch.stack([local + c, start + (2 * world_size - 1 - r) * c, c.expand_as(local)], 2)
        return torch.stack([first, second], 2).reshape(ranks.numel(), -1, 3)

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
