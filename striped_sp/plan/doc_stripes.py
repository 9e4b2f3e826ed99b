"""Per-document stripes (``stripe_size="doc"``): short documents whole, long ones in ``2N`` stripes.

A document of ``L`` tokens that is not kept whole is cut into ``2N`` contiguous stripes of about
``L / (2N)`` tokens, dealt in a round trip: stripe ``c`` goes to rank ``c`` for ``c < N`` and to rank
``2N - 1 - c`` after, so rank ``r`` holds a stripe from either end of every such document (zigzag's
pairing, applied per document).  On ring step ``t > 0`` every rank then meets, per document, two
*dense* rectangles of about ``(L / 2N)^2`` entries (one when the stripes are uneven), so the
blocks stay balanced and large; documents of at most ``whole_max`` tokens stay whole on one rank,
where their attention is one causal call at step 0 and their keys need no other rank.

No padding: a rank's stripes of the split documents are sized to fill exactly the room the whole
documents leave (``S / N`` tokens per rank), each document's share following the ranks' rooms
(:func:`_flex_counts`).  Whole documents are dealt largest score first to the rank with the least
entries whose whole tokens stay within :data:`TOKEN_SLACK` of an even share (so that the split
stripes, which fill the rest, stay near even); one that fits nowhere is split instead.

:func:`place` returns the per-rank run tables; :func:`step_entries` the exact score entries of
every (rank, ring step) that the block plans will hold, which :mod:`striped_sp.plan.placement` uses for
balance and for the cost model's prediction.
"""

from __future__ import annotations

import torch

from .solver import assign_greedy

__all__ = ["TOKEN_SLACK", "place", "step_entries", "step_cost"]

#: a rank's whole documents may exceed an even share of the whole tokens by this fraction of S/N
TOKEN_SLACK = 0.05


def _flex_counts(lengths: list[int], rooms: list[int]) -> list[list[int]]:
    """``n[d][r]``: tokens of split document ``d`` on rank ``r``; every row sums to ``lengths[d]``,
    every column to ``rooms[r]`` (``sum(lengths) == sum(rooms)``), each entry near
    ``lengths[d] * rooms[r] / sum(rooms)`` (cumulative rounding, fixed up on the ranks that still
    need the most)."""
    total = sum(lengths)
    n_ranks = len(rooms)
    need = list(rooms)
    counts, before = [], 0
    for i, length in enumerate(lengths):
        if i == len(lengths) - 1:
            row = list(need)
        else:
            after = before + length
            row = [after * room // total - before * room // total for room in rooms] if total else [0] * n_ranks
            row = [min(x, need[r]) for r, x in enumerate(row)]
            # floors of cumulative shares: the row may be a few tokens off (at most N either way)
            short = length - sum(row)
            while short != 0:
                sign = 1 if short > 0 else -1
                open_ = [r for r in range(n_ranks) if (need[r] - row[r] > 0 if sign > 0 else row[r] > 0)]
                r = max(open_, key=lambda r: (sign * (need[r] - row[r]), -r))
                row[r] += sign
                short -= sign
            before = after
        need = [nd - x for nd, x in zip(need, row)]
        counts.append(row)
    return counts


def _entries(length: int) -> int:
    return length * (length + 1) // 2


def _assign_whole(lengths: list[int], whole: list[int], local: int, n_ranks: int):
    """Whole documents by :func:`~striped_sp.plan.solver.assign_greedy`, each rank's whole tokens
    within the even share plus :data:`TOKEN_SLACK`; ``(per-rank docs, unfit docs)``."""
    share = sum(lengths[d] for d in whole) / n_ranks
    cap = min(local, int(share + TOKEN_SLACK * local))
    kept, unfit, _ = assign_greedy(lengths, whole, [cap] * n_ranks)
    return kept, unfit


def place(bounds: tuple, world_size: int, whole_max: int):
    """``(tables, kept, split, counts)``: per rank the int64 run table ``[runs, 4]`` (local start,
    first position, count, step 1), the whole documents per rank, the split documents and their
    per-rank token counts ``counts[i][r]`` (``split[i]``)."""
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    local = bounds[-1] // world_size
    whole = [d for d, n in enumerate(lengths) if 0 < n <= min(whole_max, local)]
    for _ in range(4 * world_size):
        kept, unfit = _assign_whole(lengths, whole, local, world_size)
        if not unfit:
            break
        whole = [d for d in whole if d not in set(unfit)]
    else:
        kept = [[] for _ in range(world_size)]
    placed = {d for rank_docs in kept for d in rank_docs}
    split = [d for d, n in enumerate(lengths) if d not in placed and n > 0]
    rooms = [local - sum(lengths[d] for d in kept[r]) for r in range(world_size)]
    counts = _flex_counts([lengths[d] for d in split], rooms)
    runs: list[list[tuple[int, int]]] = [[] for _ in range(world_size)]
    for d, row in zip(split, counts):
        pos = bounds[d]
        halves = [((n + 1) // 2, n // 2) for n in row]
        order = [(r, 0) for r in range(world_size)] + [(r, 1) for r in reversed(range(world_size))]
        for r, half in order:
            count = halves[r][half]
            if count:
                runs[r].append((pos, count))
            pos += count
    for r in range(world_size):
        runs[r] += [(bounds[d], lengths[d]) for d in sorted(kept[r])]
    tables = []
    for rank_runs in runs:
        counts_r = torch.tensor([c for _, c in rank_runs], dtype=torch.int64)
        local_start = torch.cumsum(counts_r, 0) - counts_r
        table = [[ls, p, c, 1] for ls, (p, c) in zip(local_start.tolist(), rank_runs)]
        tables.append(torch.tensor(table, dtype=torch.int64).view(-1, 4))
    return tables, kept, split, counts


def _halves(counts) -> tuple[torch.Tensor, torch.Tensor]:
    n = torch.tensor(counts, dtype=torch.float64).view(-1, len(counts[0]) if counts else 0)
    return torch.ceil(n / 2), torch.floor(n / 2)


def step_cost(bounds: tuple, world_size: int, kept, counts, causal_call, rect_call) -> torch.Tensor:
    """``cost[t, r]``: what rank ``r`` does on ring step ``t`` (source ``(r - t) % N``), summed
    over documents: ``causal_call(m)`` for a causal square of ``m`` rows, ``rect_call(rows, keys)``
    for a dense rectangle; both take and return float64 tensors (0 where a size is 0)."""
    n = world_size
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    cost = torch.zeros(n, n, dtype=torch.float64)
    for r in range(n):
        m = torch.tensor([float(lengths[d]) for d in kept[r]], dtype=torch.float64)
        cost[0, r] += causal_call(m).sum()
    if not counts:
        return cost
    a, b = _halves(counts)  # [docs, N]: first-half and second-half stripe of each rank
    ranks = torch.arange(n)
    for t in range(n):
        s = (ranks - t) % n
        ar, br, as_, bs = a[:, ranks], b[:, ranks], a[:, s], b[:, s]
        if t == 0:
            c = causal_call(ar) + causal_call(br) + rect_call(br, ar)
        else:
            before = (s < ranks).to(torch.float64)  # source's first stripe precedes rank's first
            # s < r: both rank stripes see the source's first stripe; s > r: the rank's second
            # stripe sees both of the source's stripes
            c = before * (rect_call(ar, as_) + rect_call(br, as_)) + (1 - before) * (
                rect_call(br, as_) + rect_call(br, bs))
        cost[t] += c.sum(0)
    return cost


def step_entries(bounds: tuple, world_size: int, kept, counts) -> torch.Tensor:
    """``entries[t, r]``: the visible score entries of rank ``r`` on ring step ``t``."""
    return step_cost(bounds, world_size, kept, counts, lambda m: m * (m + 1) / 2, lambda q, k: q * k)
