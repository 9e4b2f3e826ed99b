"""The layout the outer ring of hierarchical CP sees (:mod:`striped_sp.engine.ulysses`): after the
all-to-all over heads, member ``i`` of a Ulysses group of ``u`` holds the tokens of all ``u`` members,
member after member; on the ring of ``r = N / u`` groups that is one rank of a :class:`GroupedLayout`."""

from __future__ import annotations

import torch

from .layouts import Layout, get_layout

__all__ = ["GroupedLayout", "grouped_layout"]


class GroupedLayout(Layout):
    """The tokens of ``u`` consecutive ranks of ``base`` on ``N = r * u`` ranks, member after
    member, as one rank of ``r``: the token layout the outer ring sees after the all-to-all."""

    def __init__(self, base: Layout, u: int):
        self.base, self.u = base, u
        self.name = f"{base.name}/u{u}"
        self.seq_multiple = base.seq_multiple
        self.dense_plans = False

    @property
    def key(self) -> str:
        return f"{self.base.key}/u{self.u}"

    def check_seq_len(self, seq_len, world_size):
        self.base.check_seq_len(seq_len, world_size * self.u)

    def stride(self, world_size):
        return self.base.stride(world_size * self.u)

    def runs(self, seq_len, world_size, rank, cu_seqlens=None):
        n_base = world_size * self.u
        local = seq_len // n_base
        parts = []
        for j in range(self.u):
            runs = self.base.run_table(seq_len, n_base, rank * self.u + j, cu_seqlens).clone()
            runs[:, 0] += j * local
            parts.append(runs)
        return torch.cat(parts)

    def causal_plan(self, rank, source, world_size, local_len):
        raise NotImplementedError("a GroupedLayout runs the engine's masked plans only")


def grouped_layout(layout, u: int) -> GroupedLayout:
    """The outer ring's layout for ``layout`` with Ulysses groups of ``u``."""
    return GroupedLayout(get_layout(layout), u)
