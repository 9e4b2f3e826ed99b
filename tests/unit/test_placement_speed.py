"""The fast placement (vectorized per-document stripes, heap-based greedy, incremental retries of
the striped placement) gives exactly the outputs of the original implementation, kept below as a
frozen reference: run tables, kept / whole / striped lists, per-rank counts, entries, unfit
documents, step costs and the error raised when the stripes cannot fill the ranks."""

from __future__ import annotations

import bisect
import math
import random

import pytest
import torch

from striped_sp.plan import doc_stripes, placement, solver

# --------------------------------------------------------------------------------------------
# FROZEN REFERENCE: the implementation before the speed-up (git 81e9543), copied verbatim apart
# from names.  Do not "fix" or speed up: it defines the expected outputs.
# --------------------------------------------------------------------------------------------


def _old_assign_greedy(lengths, docs, room):
    n = len(room)
    work, placed = [0] * n, [0] * n
    kept = [[] for _ in range(n)]
    unfit = []
    for d in sorted(docs, key=lambda d: (-lengths[d], d)):
        length = lengths[d]
        fits = [r for r in range(n) if room[r] >= length]
        if not fits:
            unfit.append(d)
            continue
        r = min(fits, key=lambda r: (work[r], placed[r], r))
        kept[r].append(d)
        room[r] -= length
        placed[r] += length
        work[r] += length * (length + 1) // 2
    return kept, unfit, work


_OLD_TOKEN_SLACK = 0.05


def _old_flex_counts(lengths, rooms):
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


def _old_ds_assign_whole(lengths, whole, local, n_ranks):
    share = sum(lengths[d] for d in whole) / n_ranks
    cap = min(local, int(share + _OLD_TOKEN_SLACK * local))
    kept, unfit, _ = _old_assign_greedy(lengths, whole, [cap] * n_ranks)
    return kept, unfit


def _old_ds_place(bounds, world_size, whole_max):
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    local = bounds[-1] // world_size
    whole = [d for d, n in enumerate(lengths) if 0 < n <= min(whole_max, local)]
    for _ in range(4 * world_size):
        kept, unfit = _old_ds_assign_whole(lengths, whole, local, world_size)
        if not unfit:
            break
        whole = [d for d in whole if d not in set(unfit)]
    else:
        kept = [[] for _ in range(world_size)]
    placed = {d for rank_docs in kept for d in rank_docs}
    split = [d for d, n in enumerate(lengths) if d not in placed and n > 0]
    rooms = [local - sum(lengths[d] for d in kept[r]) for r in range(world_size)]
    counts = _old_flex_counts([lengths[d] for d in split], rooms)
    runs = [[] for _ in range(world_size)]
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


def _old_halves(counts):
    n = torch.tensor(counts, dtype=torch.float64).view(-1, len(counts[0]) if counts else 0)
    return torch.ceil(n / 2), torch.floor(n / 2)


def _old_step_cost(bounds, world_size, kept, counts, causal_call, rect_call):
    n = world_size
    lengths = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    cost = torch.zeros(n, n, dtype=torch.float64)
    for r in range(n):
        m = torch.tensor([float(lengths[d]) for d in kept[r]], dtype=torch.float64)
        cost[0, r] += causal_call(m).sum()
    if not counts:
        return cost
    a, b = _old_halves(counts)
    ranks = torch.arange(n)
    for t in range(n):
        s = (ranks - t) % n
        ar, br, as_, bs = a[:, ranks], b[:, ranks], a[:, s], b[:, s]
        if t == 0:
            c = causal_call(ar) + causal_call(br) + rect_call(br, ar)
        else:
            before = (s < ranks).to(torch.float64)
            c = before * (rect_call(ar, as_) + rect_call(br, as_)) + (1 - before) * (
                rect_call(br, as_) + rect_call(br, bs))
        cost[t] += c.sum(0)
    return cost


def _old_lengths(bounds):
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _old_striped_runs(bounds, striped, world_size, stripe):
    per_rank = [[] for _ in range(world_size)]
    offset = 0
    for d in striped:
        start, length = bounds[d], bounds[d + 1] - bounds[d]
        if stripe == 1:
            for r in range(world_size):
                t0 = (r - offset) % world_size
                if t0 < length:
                    per_rank[r].append((start + t0, (length - t0 + world_size - 1) // world_size, world_size))
        else:
            t = 0
            while t < length:
                g = (offset + t) // stripe
                end = min(length, (g + 1) * stripe - offset)
                per_rank[g % world_size].append((start + t, end - t, 1))
                t = end
        offset += length
    return per_rank


def _old_entries(length):
    return length * (length + 1) // 2


def _old_assign_whole(bounds, whole, capacity, cut_max):
    n = len(capacity)
    lengths = {d: bounds[d + 1] - bounds[d] for d in whole}
    room = list(capacity)
    kept_docs, left, work = _old_assign_greedy(lengths, whole, room)
    kept = [[(bounds[d], lengths[d]) for d in docs] for docs in kept_docs]
    small = [d for d in left if lengths[d] <= cut_max]
    unfit = [d for d in left if lengths[d] > cut_max]
    cut = [[] for _ in range(n)]
    for d in small:
        pos = bounds[d]
        for r in sorted(range(n), key=lambda r: (-room[r], r)):
            take = min(room[r], bounds[d + 1] - pos)
            if take <= 0:
                continue
            cut[r].append((pos, take))
            room[r] -= take
            work[r] += _old_entries(take)
            pos += take
            if pos == bounds[d + 1]:
                break
    return [c + sorted(k) for c, k in zip(cut, kept)], work, unfit


def _old_striped_capacity(bounds, striped, world_size, stripe, local):
    runs = _old_striped_runs(bounds, striped, world_size, stripe)
    return runs, [local - sum(c for _, c, _ in r) for r in runs]


def _old_place(bounds, world_size, stripe, whole_max):
    seq_len = bounds[-1]
    local = seq_len // world_size
    lengths = _old_lengths(bounds)
    cut_max = max(64, local // 64)
    whole = [d for d, n in enumerate(lengths) if n <= min(whole_max, local)]
    for attempt in range(2 * world_size + 1):
        if attempt == 2 * world_size:
            cut_max = local
        whole_set = set(whole)
        striped = [d for d in range(len(lengths)) if d not in whole_set]
        striped_runs, capacity = _old_striped_capacity(bounds, striped, world_size, stripe, local)
        if min(capacity) < 0 or (not whole and max(capacity) > 0):
            raise ValueError(
                f"stripe_size={stripe}: the striped documents ({seq_len - sum(capacity)} tokens) do not fall "
                f"evenly on {world_size} ranks of {local} tokens (room left per rank {capacity}); use a stripe "
                "size that divides the row by world_size * stripe_size, or doc_placement='auto' to fill the "
                "ranks with whole documents")
        placed, entries, unfit = _old_assign_whole(bounds, whole, capacity, cut_max)
        if not unfit:
            break
        drop = max(unfit, key=lambda d: (lengths[d], d))
        whole = [d for d in whole if d != drop]
    tables = []
    for r in range(world_size):
        rows = [(p, c, s) for p, c, s in striped_runs[r]] + [(p, c, 1) for p, c in placed[r]]
        counts_r = torch.tensor([c for _, c, _ in rows], dtype=torch.int64)
        local_start = torch.cumsum(counts_r, 0) - counts_r
        table = torch.tensor([[ls, p, c, s] for ls, (p, c, s) in zip(local_start.tolist(), rows)], dtype=torch.int64)
        tables.append(table.view(-1, 4))
    return tables, whole, striped, entries


def _old_whole_pieces(bounds, tables, whole):
    whole = set(whole)
    per_rank = []
    for t in tables:
        rows = []
        for _, first, count, step in t.tolist():
            doc = bisect.bisect_right(bounds, first) - 1
            if step == 1 and doc in whole:
                rows.append((doc, count))
        per_rank.append(rows)
    return per_rank


def _old_cross_entries(pieces):
    by_doc = {}
    for rows in pieces:
        for doc, count in rows:
            by_doc.setdefault(doc, []).append(count)
    total = 0
    for counts in by_doc.values():
        before = 0
        for c in counts:
            total += c * before
            before += c
    return total


# --------------------------------------------------------------------------------------------
# END OF FROZEN REFERENCE
# --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _one_thread():
    """Planning runs on one core (small tensor ops: threads only wait for each other)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _mix(rng: random.Random, seq_len: int, median: float, sigma: float, empty: float = 0.0) -> tuple:
    """A packed row of ``seq_len`` tokens: lognormal document lengths (the last one cut at the
    row end), a fraction ``empty`` of them of zero length."""
    bounds = [0]
    while bounds[-1] < seq_len:
        n = 0 if rng.random() < empty else max(1, round(math.exp(rng.gauss(math.log(median), sigma))))
        bounds.append(min(seq_len, bounds[-1] + n))
    return tuple(bounds)


def _rows(rng: random.Random, count: int):
    """``(bounds, N)``: lognormal mixes (medians 16..8192, sigmas 0..2), fixed lengths, single
    documents, rows with empty documents; N in {1, 2, 3, 4, 8, 16, 64}."""
    for i in range(count):
        n = rng.choice([1, 2, 3, 4, 8, 16, 64])
        per_rank = rng.choice([64, 256, 1024, 2048]) if n <= 16 else rng.choice([64, 256])
        seq_len = n * per_rank
        kind = i % 8
        if kind == 0:
            bounds = tuple(sorted(set(range(0, seq_len, max(3, seq_len // rng.choice([5, 64, 600])))) | {seq_len}))
        elif kind == 1:
            bounds = (0, seq_len)
        elif kind == 2:
            bounds = _mix(rng, seq_len, rng.choice([16, 64, 256]), rng.choice([0.3, 1.2]), empty=0.1)
        else:
            median = 2 ** rng.uniform(4, 13)
            bounds = _mix(rng, seq_len, median, rng.choice([0.0, 0.5, 1.2, 2.0]))
        yield bounds, n


def _whole_maxes(local: int) -> list[int]:
    return sorted({0, 1, 16, local // 4, local, 1 << 40})


def _same_tables(new, old):
    assert len(new) == len(old)
    for a, b in zip(new, old):
        assert a.dtype == b.dtype == torch.int64 and a.shape == b.shape and torch.equal(a, b), (a, b)


def _predict_call(rows, keys, causal):
    """:func:`striped_sp.plan.placement._predict_doc`'s block cost, with fixed constants."""
    rows = torch.clamp(rows, min=1e-9)
    area = rows * torch.minimum(keys, rows / 2 + 3.7) if causal else rows * keys
    ns = 0.011 * area * (1 + 33.3 / rows) + 4100.0
    return torch.where((rows >= 1) & (keys >= 1), ns, torch.zeros_like(ns))


def test_assign_greedy_matches_the_reference():
    rng = random.Random(1)
    for _ in range(300):
        n = rng.choice([1, 2, 3, 5, 8, 64])
        docs = [rng.choice([0, 1, 2, 5, 16, 100, rng.randrange(1, 3000)]) for _ in range(rng.randrange(0, 80))]
        as_dict = rng.random() < 0.5
        lengths = dict(enumerate(docs)) if as_dict else docs
        chosen = [d for d in range(len(docs)) if rng.random() < 0.8]
        room = [rng.choice([0, 3, 100, rng.randrange(0, 20000)]) for _ in range(n)]
        if rng.random() < 0.3:
            room = [rng.randrange(0, 5000)] * n
        old_room, new_room = list(room), list(room)
        assert solver.assign_greedy(lengths, chosen, new_room) == _old_assign_greedy(lengths, chosen, old_room)
        assert new_room == old_room


def test_cross_entries_match_the_reference():
    rng = random.Random(5)
    for _ in range(200):
        pieces = [[(rng.randrange(6), rng.randrange(0, 300)) for _ in range(rng.randrange(4))]
                  for _ in range(rng.randrange(1, 6))]
        assert placement._cross_entries(pieces) == _old_cross_entries(pieces)


def test_flex_counts_match_the_reference():
    rng = random.Random(2)
    for _ in range(300):
        n = rng.choice([1, 2, 3, 4, 8, 16, 64, 128])
        lengths = [rng.choice([1, 2, 3, rng.randrange(1, 50), rng.randrange(1, 5000)])
                   for _ in range(rng.randrange(1, 60))]
        total = sum(lengths)
        weights = [rng.random() ** rng.choice([0, 1, 4]) for _ in range(n)]
        rooms = [int(total * w / sum(weights)) for w in weights]
        rooms[rng.randrange(n)] += total - sum(rooms)
        assert doc_stripes._flex_counts(lengths, rooms) == _old_flex_counts(lengths, rooms)


def test_doc_stripes_match_the_reference():
    rng = random.Random(3)
    causal, rect = (lambda m: _predict_call(m, m, True)), (lambda q, k: _predict_call(q, k, False))
    for i, (bounds, n) in enumerate(_rows(rng, 160)):
        local = bounds[-1] // n
        for j, whole_max in enumerate(rng.sample(_whole_maxes(local), 2)):
            tables, kept, split, counts = doc_stripes.place(bounds, n, whole_max)
            o_tables, o_kept, o_split, o_counts = _old_ds_place(bounds, n, whole_max)
            _same_tables(tables, o_tables)
            assert (kept, split, counts) == (o_kept, o_split, o_counts)
            if j or (n == 64 and i % 4):
                continue  # the reference's step costs are slow: some placements only
            new = doc_stripes.step_entries(bounds, n, kept, counts)
            old = _old_step_cost(bounds, n, kept, counts, lambda m: m * (m + 1) / 2, lambda q, k: q * k)
            assert new.dtype == torch.float64 and torch.equal(new, old)
            new = doc_stripes.step_cost(bounds, n, kept, counts, causal, rect)
            assert torch.equal(new, _old_step_cost(bounds, n, kept, counts, causal, rect))  # bit for bit


def _old_or_error(fn, *args):
    try:
        return fn(*args), None
    except ValueError as e:
        return None, str(e)


def test_striped_placement_matches_the_reference():
    rng = random.Random(4)
    for i, (bounds, n) in enumerate(_rows(rng, 200)):
        if i % 5 == 0 and n > 1:  # rows that do not divide by N
            bounds = bounds[:-1] + (bounds[-1] - rng.randrange(1, n),) if bounds[-1] - bounds[-2] > n else bounds
        local = bounds[-1] // n
        for stripe in rng.sample([1, 8, 64, 512], 2):
            whole_max = rng.choice(_whole_maxes(local))
            new, new_err = _old_or_error(placement._place, bounds, n, stripe, whole_max)
            old, old_err = _old_or_error(_old_place, bounds, n, stripe, whole_max)
            assert new_err == old_err
            if old is None:
                continue
            _same_tables(new[0], old[0])
            assert new[1:] == old[1:]
            assert all(type(x) is int for x in new[3])
            pieces = placement._whole_pieces(bounds, new[0], new[1])
            assert pieces == _old_whole_pieces(bounds, old[0], old[1])
            assert placement._cross_entries(pieces) == _old_cross_entries(pieces)
            striped = new[2]
            assert placement._striped_runs(bounds, striped, n, stripe) == _old_striped_runs(bounds, striped, n, stripe)
            assert (placement._striped_capacity(bounds, striped, n, stripe, local)
                    == _old_striped_capacity(bounds, striped, n, stripe, local))
            capacity = _old_striped_capacity(bounds, striped, n, stripe, local)[1]
            if min(capacity) >= 0:
                cut_max = rng.choice([64, local])
                assert (placement._assign_whole(bounds, new[1], capacity, cut_max)
                        == _old_assign_whole(bounds, new[1], capacity, cut_max))
    assert placement._lengths((0, 3, 3, 10)) == [3, 0, 7]
    assert placement._entries(4) == 10


@pytest.mark.parametrize("seq_len, n", [(1 << 17, 8), (1 << 18, 32), (1 << 19, 64)])
def test_the_web_mix_at_scale_matches_the_reference(seq_len, n):
    """The project's sizes, scaled down: the striped placement retries up to 2N times here."""
    from striped_sp.bench.docs import packed_row, parse_docs

    bounds = tuple(packed_row(parse_docs("lognormal:median=1024,sigma=1.2"), seq_len))
    local = seq_len // n
    causal, rect = (lambda m: _predict_call(m, m, True)), (lambda q, k: _predict_call(q, k, False))
    for whole_max in (0, 1024, local):
        tables, kept, split, counts = doc_stripes.place(bounds, n, whole_max)
        old = _old_ds_place(bounds, n, whole_max)
        _same_tables(tables, old[0])
        assert (kept, split, counts) == old[1:]
        assert torch.equal(doc_stripes.step_cost(bounds, n, kept, counts, causal, rect),
                           _old_step_cost(bounds, n, kept, counts, causal, rect))
        for stripe in (1, 512):
            new, new_err = _old_or_error(placement._place, bounds, n, stripe, whole_max)
            old, old_err = _old_or_error(_old_place, bounds, n, stripe, whole_max)
            assert new_err == old_err
            if old is not None:
                _same_tables(new[0], old[0])
                assert new[1:] == old[1:]
