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

Planning is per batch, at up to 1M tokens on 128 ranks: the counts, runs and step costs are
tensor arithmetic over ``[documents, N]``; the only Python loop over documents is the rounding
fix-up of :func:`_flex_counts`, a few heap operations each.

:func:`place` returns the per-rank run tables; :func:`step_entries` the exact score entries of
every (rank, ring step) that the block plans will hold, which :mod:`striped_sp.plan.placement` uses for
balance and for the cost model's prediction.
"""

from __future__ import annotations

import array
import heapq
import itertools
import operator

import torch

from .solver import Rerun

__all__ = ["TOKEN_SLACK", "place", "step_entries", "step_cost", "run_tables", "striped_rows"]

#: a rank's whole documents may exceed an even share of the whole tokens by this fraction of S/N
TOKEN_SLACK = 0.05
#: :func:`step_cost` works on this many (step, document, rank) entries at once
_CHUNK = 1 << 15


def _flex_table(lengths: list[int], rooms: list[int]) -> torch.Tensor:
    """:func:`_flex_counts` as an int64 tensor ``[docs, N]``.

    Row ``i`` starts as the difference of cumulative floors ``F[i] = floor(end_i * room / total)``
    (``end_i``: the tokens of documents ``0..i``), then is cut to what each rank still needs and
    fixed up one token at a time: while short, a token more on the rank that still needs the most
    (ties: the lower rank); while over, a token less on the rank, among those with tokens in the
    row, that needs the least.  The state carried from row to row is ``D``, how far each rank's
    cumulative count is from ``F``: what a rank still needs after row ``i`` before its fix-up is
    ``room - F[i] - D``, so only the fix-up runs per document, on a heap of ranks."""
    n_docs, n = len(lengths), len(rooms)
    if not n_docs:
        return torch.zeros(0, n, dtype=torch.int64)
    total = sum(lengths)
    room = torch.tensor(rooms, dtype=torch.int64)
    length = torch.tensor(lengths, dtype=torch.int64)
    if total:
        cum = torch.div(torch.cumsum(length, 0)[:, None] * room, total, rounding_mode="floor")
    else:
        cum = torch.zeros(n_docs, n, dtype=torch.int64)
    base = torch.diff(cum, dim=0, prepend=torch.zeros(1, n, dtype=torch.int64))  # the rows before any fix-up
    slack = room - cum  # need - row before the fix-up, while D = 0
    short0 = (length - base.sum(1)).tolist()
    ranks = torch.arange(n)
    # heap keys of (slack, rank) with D = 0: the most needed first (ties: lower rank) ...
    more_keys = (-(slack * n + (n - 1 - ranks))).view(-1).tolist()  # flat: few objects for the collector
    # ... and the least needed first (ties: lower rank); D * n is added to / taken from them
    less_keys = (slack * n + ranks).view(-1).tolist()
    min_slack = (slack.min(1).values * n).tolist()
    slack_flat, base_flat = slack.view(-1).tolist(), base.view(-1).tolist()
    dev = array.array("q", bytes(8 * n))  # D * n
    high = 0  # max(dev)
    devs = []
    add, sub = operator.add, operator.sub
    heapify, heapreplace, heappop = heapq.heapify, heapq.heapreplace, heapq.heappop
    for i in range(n_docs - 1):
        short = short0[i]
        cut = min_slack[i] < high  # else no rank needs less than F gives it: the row is not cut
        if short == 0 and not cut:
            devs.append(dev)
            continue
        lo, hi = i * n, i * n + n
        row = base_flat[lo:hi]
        dev = dev[:]
        if not cut:
            if short > 0:
                heap = list(map(add, more_keys[lo:hi], dev))
            else:
                heap = list(itertools.compress(map(sub, less_keys[lo:hi], dev), row))
        else:
            s = [x - d // n for x, d in zip(slack_flat[lo:hi], dev)]
            for r, x in enumerate(s):
                if x < 0:  # the row takes only what rank r still needs
                    row[r] += x
                    dev[r] += x * n
                    short -= x
                    s[r] = 0
            if short > 0:
                heap = [-(x * n + n - 1 - r) for r, x in enumerate(s)]
            else:
                heap = [x * n + r for r, x in enumerate(s) if row[r] > 0]
        if 0 < short <= len(heap):
            first = sorted(heap)[:short]
            if first[0] + n > first[-1]:  # no rank picked twice: the `short` most in need, one token each
                for key in first:
                    dev[(n - 1 - (-key) % n)] += n
                high = max(dev)
                devs.append(dev)
                continue
        heapify(heap)
        if short > 0:  # a token more where the most is still needed (ties: lower rank)
            for _ in range(short):
                key = heap[0]
                dev[(n - 1 - (-key) % n)] += n
                heapreplace(heap, key + n)
        elif short < 0:  # a token less where the least is needed, among ranks with tokens in the row
            for _ in range(-short):
                key = heap[0]
                r = key % n
                dev[r] -= n
                row[r] -= 1
                if row[r] > 0:
                    heapreplace(heap, key + n)
                else:
                    heappop(heap)
        high = max(dev)
        devs.append(dev)
    dev = torch.frombuffer(bytearray(b"".join(devs)), dtype=torch.int64) if devs else torch.zeros(0, dtype=torch.int64)
    ends = cum[:-1] + torch.div(dev.view(-1, n), n, rounding_mode="floor")
    ends = torch.cat([ends, room[None]])  # the last row takes what every rank still needs
    return torch.diff(ends, dim=0, prepend=torch.zeros(1, n, dtype=torch.int64))


def _floor_table(lengths: list[int], rooms: list[int]) -> torch.Tensor:
    """:func:`_flex_table` before its fix-up (int64 ``[docs, N]``): the differences of the
    cumulative floors, each entry within a token of the share ``lengths[d] * rooms[r] / total``
    (columns sum to the rooms, rows may miss their length by under ``N`` tokens).  For a coarse
    prediction only: no Python loop over documents."""
    n = len(rooms)
    total = sum(lengths)
    if not lengths or not total:
        return torch.zeros(len(lengths), n, dtype=torch.int64)
    room = torch.tensor(rooms, dtype=torch.int64)
    cum = torch.div(torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)[:, None] * room, total,
                    rounding_mode="floor")
    return torch.diff(cum, dim=0, prepend=torch.zeros(1, n, dtype=torch.int64))


def _flex_counts(lengths: list[int], rooms: list[int]) -> list[list[int]]:
    """``n[d][r]``: tokens of split document ``d`` on rank ``r``; every row sums to ``lengths[d]``,
    every column to ``rooms[r]`` (``sum(lengths) == sum(rooms)``), each entry near
    ``lengths[d] * rooms[r] / sum(rooms)`` (cumulative rounding, fixed up on the ranks that still
    need the most)."""
    return _flex_table(lengths, rooms).tolist()


def _entries(length: int) -> int:
    return length * (length + 1) // 2


def _whole_cap(lengths: list[int], whole: list[int], local: int, n_ranks: int) -> int:
    """Each rank's whole tokens: within the even share plus :data:`TOKEN_SLACK`."""
    share = sum(lengths[d] for d in whole) / n_ranks
    return min(local, int(share + TOKEN_SLACK * local))


def run_tables(n_ranks: int, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per rank, the int64 run table ``[runs, 4]`` (local start, first position, count, step)
    of runs given as int64 rows ``(rank, first position, count, step)`` in ``parts``, each
    grouped by rank in rank order: a rank's runs of ``parts[0]`` first, then of ``parts[1]``..."""
    before = torch.zeros(n_ranks, dtype=torch.int64)  # each rank's tokens in the parts before
    pieces = []
    for rows in parts:
        rows = rows.view(-1, 4).clone()
        rank, count = rows[:, 0].clone(), rows[:, 2]
        tokens = torch.zeros(n_ranks, dtype=torch.int64).index_add_(0, rank, count)
        rank_start = torch.cumsum(tokens, 0) - tokens - before  # tokens of this part before rank r's rows
        rows[:, 0] = torch.cumsum(count, 0) - count - rank_start[rank]
        pieces.append(torch.split(rows, torch.bincount(rank, minlength=n_ranks).tolist()))
        before += tokens
    return [torch.cat([p[r] for p in pieces]) for r in range(n_ranks)]


def striped_rows(bounds: tuple, docs: list[int], n_ranks: int, stripe: int, order: str = "round") -> torch.Tensor:
    """The runs of documents ``docs`` of a row dealt as one sub-row (in that order) in stripes of
    ``stripe`` tokens, stripe ``g`` to rank ``g % N`` (``stripe == 1``: one run of step ``N`` per
    document and rank; ``order="mirror"``: :func:`~striped_sp.plan.mirror.mirrored_rows`): int64 rows
    ``(rank, first position, count, step)``, grouped by rank in rank order, each rank's in sub-row
    order (for :func:`run_tables`)."""
    n = n_ranks
    start = torch.tensor([bounds[d] for d in docs], dtype=torch.int64)
    length = torch.tensor([bounds[d + 1] - bounds[d] for d in docs], dtype=torch.int64)
    if order == "mirror":
        from .mirror import mirrored_rows

        return mirrored_rows(start, length, n, stripe)
    offset = torch.cumsum(length, 0) - length  # where each document starts in the sub-row
    if stripe == 1:
        ranks = torch.arange(n)
        t0 = (ranks - offset[:, None]) % n  # [docs, N]: the document's first token on each rank
        rows = torch.stack([ranks.expand_as(t0), start[:, None] + t0, (length[:, None] - t0 + n - 1) // n,
                            torch.full_like(t0, n)], 2)
        return rows.transpose(0, 1)[(t0 < length[:, None]).T]
    first_g = offset // stripe
    pieces = torch.where(length > 0, (offset + length - 1) // stripe - first_g + 1, 0)  # stripes each one meets
    doc = torch.repeat_interleave(torch.arange(len(docs)), pieces)
    g = first_g[doc] + torch.arange(len(doc)) - (torch.cumsum(pieces, 0) - pieces)[doc]
    lo = torch.maximum(g * stripe, offset[doc])
    hi = torch.minimum((g + 1) * stripe, (offset + length)[doc])
    rank = g % n
    rows = torch.stack([rank, start[doc] + lo - offset[doc], hi - lo, torch.ones_like(g)], 1)
    return rows[torch.sort(rank, stable=True).indices]


def place(bounds: tuple, world_size: int, whole_max: int, tables: bool = True, coarse: bool = False):
    """``(tables, kept, split, counts)``: per rank the int64 run table ``[runs, 4]`` (local start,
    first position, count, step 1), the whole documents per rank, the split documents and their
    per-rank token counts ``counts[i][r]`` (``split[i]``).  ``tables=False``: ``None`` for the
    tables, and the counts as the int64 tensor ``[split, N]`` (a prediction needs only those);
    ``coarse`` (with ``tables=False``): counts of :func:`_floor_table`, not the placement's own."""
    n = world_size
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    local = bounds[-1] // n
    whole = [d for d, x in enumerate(lengths) if 0 < x <= min(whole_max, local)]
    # documents that fit nowhere within the cap are split, and the rest dealt again (a smaller cap)
    greedy = Rerun(sorted(whole, key=lambda d: (-lengths[d], d)), lengths, n)
    for _ in range(4 * n):
        greedy.run([_whole_cap(lengths, whole, local, n)] * n)
        kept, unfit, _ = greedy.result()
        if not unfit:
            break
        unfit = set(unfit)
        whole = [d for d in whole if d not in unfit]
        greedy.remove([i for i, d in enumerate(greedy.docs) if d in unfit])
    else:
        kept = [[] for _ in range(n)]
    placed = {d for rank_docs in kept for d in rank_docs}
    split = [d for d, x in enumerate(lengths) if d not in placed and x > 0]
    rooms = [local - sum(lengths[d] for d in kept[r]) for r in range(n)]
    if coarse and not tables:
        return None, kept, split, _floor_table([lengths[d] for d in split], rooms)
    table = _flex_table([lengths[d] for d in split], rooms)  # [split, N]
    if not tables:
        return None, kept, split, table
    # stripe c of a split document: rank c, then rank 2N - 1 - c (first halves, then second halves back)
    first, second = (table + 1) // 2, table // 2
    dealt = torch.cat([first, second.flip(1)], 1)
    start = torch.tensor([bounds[d] for d in split], dtype=torch.int64)[:, None] + torch.cumsum(dealt, 1) - dealt
    pos = torch.stack([start[:, :n], start[:, n:].flip(1)], 2)  # [split, N, 2]: rank r's two stripes
    count = torch.stack([first, second], 2)
    rank = torch.arange(n)[None, :, None].expand_as(count)
    runs = torch.stack([rank, pos, count, torch.ones_like(count)], 3).transpose(0, 1)  # [N, split, 2, 4]
    split_runs = runs[count.transpose(0, 1) > 0]
    whole_runs = torch.tensor([(r, bounds[d], lengths[d], 1) for r in range(n) for d in sorted(kept[r])],
                              dtype=torch.int64)
    return run_tables(n, [split_runs, whole_runs]), kept, split, table.tolist()


def _halves(counts) -> tuple[torch.Tensor, torch.Tensor]:
    """Each split document's first-half and second-half stripe per rank (float64 ``[docs, N]``) of
    ``counts`` (lists, or an int64 tensor ``[docs, N]``)."""
    if isinstance(counts, torch.Tensor):
        n = counts.to(torch.float64)
        return torch.ceil(n / 2), torch.floor(n / 2)
    flat = array.array("q", itertools.chain.from_iterable(counts))
    n = torch.frombuffer(flat, dtype=torch.int64) if flat else torch.zeros(0, dtype=torch.int64)
    n = n.to(torch.float64).view(-1, len(counts[0]) if counts else 0)
    return torch.ceil(n / 2), torch.floor(n / 2)


def step_cost(bounds: tuple, world_size: int, kept, counts, causal_call, rect_call, rect_factors=None) -> torch.Tensor:
    """``cost[t, r]``: what rank ``r`` does on ring step ``t`` (source ``(r - t) % N``), summed
    over documents: ``causal_call(m)`` for a causal square of ``m`` rows, ``rect_call(rows, keys)``
    for a dense rectangle; both take and return float64 tensors (0 where a size is 0), element
    by element.  ``rect_factors(rows, keys)``, where given, is ``rect_call`` as a sum of products
    ``[(f(rows), g(keys)), ...]`` (:meth:`~striped_sp.plan.cost.CostModel.rect_factors`): then the
    steps ``t > 0`` are three sums of ``[N, docs] x [docs, N]`` products, as in :func:`step_entries`
    (equal to the loop below up to float64 rounding).

    Per step one ``[docs, N]`` sum: on step ``t > 0`` rank ``r``'s second stripe sees the source's
    first, and its first stripe (``r >= t``, the source before it) or second (``r < t``) sees the
    source's stripe of the same half.  The stripes take few distinct sizes, so ``rect_call`` runs
    once on every pair of sizes and each step looks its rectangles up."""
    n = world_size
    cost = torch.zeros(n, n, dtype=torch.float64)
    m = torch.tensor([float(bounds[d + 1] - bounds[d]) for docs in kept for d in docs], dtype=torch.float64)
    sizes = [len(docs) for docs in kept]
    if rect_factors is not None:  # a prediction: one sum per rank (in another order than the loop's)
        cost[0].index_add_(0, torch.repeat_interleave(torch.arange(n), torch.tensor(sizes, dtype=torch.int64)),
                           causal_call(m))
    else:
        cost[0] = torch.stack([w.sum() for w in torch.split(causal_call(m), sizes)])
    if len(counts) == 0:
        return cost
    a, b = _halves(counts)  # [docs, N]: first-half and second-half stripe of each rank
    cost[0] += (causal_call(a) + causal_call(b) + rect_call(b, a)).sum(0)
    if rect_factors is not None:
        def pairs(rows, keys):  # [r, s]: the rectangles of rows' stripes on r against keys' on s
            return sum(f.T @ g for f, g in rect_factors(rows, keys))

        r = torch.arange(n)
        t = torch.arange(1, n)[:, None]
        s = (r - t) % n
        cost[1:] = pairs(b, a)[r, s] + torch.where(r >= t, pairs(a, a)[r, s], pairs(b, b)[r, s])
        return cost
    sizes, index = torch.unique(torch.cat([a, b], 1), return_inverse=True)
    u = len(sizes)
    if u * u <= a.numel():  # every pair of sizes costs less than one step
        table = rect_call(sizes.repeat_interleave(u), sizes.repeat(u))
        a_keys, b_keys = index[:, :n], index[:, n:]
        a_rows, b_rows = a_keys * u, b_keys * u  # a pair's entry: row index * u + key index

        def rect(rows, keys):
            return table.index_select(0, (rows + keys).reshape(-1)).view(rows.shape)
    else:
        a_rows, b_rows, a_keys, b_keys, rect = a, b, a, b, rect_call
    docs = len(a)
    chunk = _CHUNK // max(1, docs * n)  # steps at once
    if chunk < 2:  # large steps: one at a time, the sources' stripes by rotation
        for t in range(1, n):
            a_s = torch.cat([a_keys[:, n - t:], a_keys[:, :n - t]], 1)  # the source's first stripes
            rows = torch.cat([b_rows[:, :t], a_rows[:, t:]], 1)  # r >= t: the source's stripes come first
            keys = torch.cat([b_keys[:, n - t:], a_keys[:, :n - t]], 1)
            cost[t] += (rect(b_rows, a_s) + rect(rows, keys)).sum(0)
        return cost
    a_rows, b_rows = a_rows[:, None, :], b_rows[:, None, :]
    for t0 in range(1, n, chunk):  # small steps: several at once, [docs, steps, N]
        t = torch.arange(t0, min(n, t0 + chunk))[:, None]
        source = ((torch.arange(n) - t) % n).view(-1)
        late = torch.arange(n) >= t
        a_s = a_keys.index_select(1, source).view(docs, -1, n)
        b_s = b_keys.index_select(1, source).view(docs, -1, n)
        c = rect(b_rows.expand_as(a_s), a_s) + rect(torch.where(late, a_rows, b_rows), torch.where(late, a_s, b_s))
        c = c.transpose(0, 1).contiguous()  # each step's [docs, N] summed as one block, as above
        for j in range(len(t)):
            cost[t0 + j] += c[j].sum(0)
    return cost


def step_entries(bounds: tuple, world_size: int, kept, counts) -> torch.Tensor:
    """``entries[t, r]``: the visible score entries of rank ``r`` on ring step ``t``
    (:func:`step_cost` of ``m (m + 1) / 2`` and ``rows * keys``; sums of stripe products, so three
    ``[N, docs] x [docs, N]`` products give every step at once, exact in float64)."""
    n = world_size
    cost = torch.zeros(n, n, dtype=torch.float64)
    m = torch.tensor([float(bounds[d + 1] - bounds[d]) for docs in kept for d in docs], dtype=torch.float64)
    rank = torch.repeat_interleave(torch.arange(n), torch.tensor([len(docs) for docs in kept], dtype=torch.int64))
    cost[0].index_add_(0, rank, m * (m + 1) / 2)
    if len(counts) == 0:
        return cost
    a, b = _halves(counts)
    cost[0] += (a * (a + 1) / 2 + b * (b + 1) / 2 + a * b).sum(0)
    r = torch.arange(n)
    t = torch.arange(1, n)[:, None]
    s = (r - t) % n  # [steps, N]: the source of each rank
    same = torch.where(r >= t, (a.T @ a)[r, s], (b.T @ b)[r, s])  # the stripes of one half
    cost[1:] = (b.T @ a)[r, s] + same
    return cost
