"""The layout the outer ring of hierarchical CP runs (:mod:`striped_sp.engine.ulysses`).

After the all-to-all over heads, member ``i`` of a Ulysses group of ``u`` holds the tokens of all
``u`` members, member after member (the *gathered* order); on the ring of ``r = N / u`` groups that
is one rank of a :class:`GroupedLayout`.  The layout says in which order the engine *runs* them,
and :meth:`GroupedLayout.run_order` gives the permutation from the gathered order to it (plan data,
built once per batch with the plan; the executor applies it, :mod:`striped_sp.engine.run_order`):

* a ring of one (``u = N``, pure Ulysses): the whole row in its natural order, one contiguous rank.
  The causal ring is one causal call over the row (what DeepSpeed-Ulysses runs); with documents
  or a window the masked plan of one contiguous rank (one varlen call where the kernel has one).
  The permutation is the identity for ``contiguous``, so none is applied there.
* an outer ring (``u < N``): the gathered order itself.  A ring step pairs the ``u`` member blocks
  held here with the ``u`` received, and each pair of member blocks meets as two ranks of the base
  layout on ``N`` ranks do, so the dense ring runs the base layout's own block plans, shifted to
  the members' rows: ``u * u`` calls per step at most (a causal or strict-causal square per pair
  under ``striped``; under ``contiguous`` a group's tokens are one slice of the row, which runs
  as the base layout on ``r`` ranks).  Documents and windows run the engine's masked plans on the gathered runs.
"""

from __future__ import annotations

import torch

from .layouts import BlockCall, Layout, get_layout

__all__ = ["GroupedLayout", "grouped_layout"]

_ALL = slice(None)


def _shifted(rows: slice, offset: int, n: int) -> slice:
    """``rows`` of a member's ``n`` tokens as rows of the gathered block (the member's at ``offset``)."""
    start, stop, step = rows.indices(n)
    if step != 1:
        raise ValueError(f"a block plan's slice {rows} must have step 1")
    return slice(offset + start, offset + stop)


class GroupedLayout(Layout):
    """The tokens of ``u`` consecutive ranks of ``base`` on ``N = r * u`` ranks, as one rank of the
    outer ring of ``r``: member after member for ``r > 1``, the natural order of the row for
    ``r = 1`` (:meth:`run_order` maps the gathered tokens to it)."""

    def __init__(self, base: Layout, u: int):
        self.base, self.u = base, u
        self.name = f"{base.name}/u{u}"
        self.seq_multiple = base.seq_multiple
        # the dense ring pairs the base layout's blocks (a ring of one: one causal call)
        self.dense_plans = base.dense_plans

    @property
    def key(self) -> str:
        return f"{self.base.key}/u{self.u}"

    def check_seq_len(self, seq_len, world_size):
        self.base.check_seq_len(seq_len, world_size * self.u)

    def stride(self, world_size):
        return 1 if world_size == 1 else self.base.stride(world_size * self.u)

    def window_block(self, world_size, local_len, mask=None):
        return local_len if world_size == 1 else None

    def gathered_runs(self, seq_len, world_size, rank, cu_seqlens=None) -> torch.Tensor:
        """The gathered tokens of outer rank ``rank`` (its members' shards, member after member) as
        runs ``[runs, 4]`` (local start, first position, count, step)."""
        n_base = world_size * self.u
        local = seq_len // n_base
        parts = []
        for j in range(self.u):
            runs = self.base.run_table(seq_len, n_base, rank * self.u + j, cu_seqlens).clone()
            runs[:, 0] += j * local
            parts.append(runs)
        return torch.cat(parts)

    def runs(self, seq_len, world_size, rank, cu_seqlens=None):
        if world_size == 1:  # the whole row in natural order
            return [(0, 0, seq_len)]
        return self.gathered_runs(seq_len, world_size, rank, cu_seqlens)

    def run_order(self, seq_len, world_size, rank, cu_seqlens=None) -> torch.Tensor | None:
        """int64 ``[s]`` (``s = seq_len / world_size``): run row ``p`` is gathered row ``order[p]``
        (``gathered.index_select(1, order)``); ``None`` when the run order is the gathered one
        (an outer ring, or a ring of one whose gathered row is already in natural order)."""
        if world_size != 1:
            return None
        runs = self.gathered_runs(seq_len, 1, 0, cu_seqlens)  # every member's, expanded at once
        count = runs[:, 2]
        run = torch.repeat_interleave(torch.arange(runs.size(0)), count, output_size=seq_len)
        position = runs[run, 1] + runs[run, 3] * (torch.arange(seq_len) - (torch.cumsum(count, 0) - count)[run])
        if torch.equal(position, torch.arange(seq_len)):
            return None
        order = torch.empty_like(position)
        order[position] = torch.arange(seq_len)
        return order

    def causal_plan(self, rank, source, world_size, local_len):
        if world_size == 1:
            return [BlockCall(_ALL, _ALL, True)]
        if self.base.contiguous_slices:  # a group's tokens are one slice of the row: the base ring of r
            return self.base.causal_plan(rank, source, world_size, local_len)
        n_base, n = world_size * self.u, local_len // self.u
        diagonal, rest = [], []
        for j in range(self.u):  # query member j against key member i
            for i in range(self.u):
                calls = self.base.causal_plan(rank * self.u + j, source * self.u + i, n_base, n)
                # strict=False: the striped strict block's aligned form runs every query row of the
                # block, which here is the gathered block, not the member's
                shifted = [BlockCall(_shifted(c.q, j * n, n), _shifted(c.kv, i * n, n), c.causal) for c in calls]
                (diagonal if i == j else rest).extend(shifted)
        # on the ring's first step the members' own blocks come first: together they cover every
        # query row once, so the accumulators start from them (engine/step.py's Accumulator)
        return diagonal + rest


def grouped_layout(layout, u: int) -> GroupedLayout:
    """The outer ring's layout for ``layout`` with Ulysses groups of ``u``."""
    return GroupedLayout(get_layout(layout), u)
