"""Native varlen programs compiled for a whole plan at once (:func:`native_programs`): the groups
of every call, against what each call's segments say written out by hand, and the arena's views
still right after the one copy to the device."""

import random

import torch

from striped_sp.kernels.segments import Segments
from striped_sp.kernels.arena import Arena
from striped_sp.kernels.native import native_programs


def _call(rng, count, nq):
    lq = [rng.randint(1, 9) for _ in range(count)]
    lk = [rng.randint(1, 9) for _ in range(count)]
    # causal and full segments, and (1, 0)-bands of one row (a band's first block is the band):
    # windows are folded into these classes, test_windows_fold_into_the_causal_and_full_classes
    wr = [rng.choice([-1, 0]) for _ in range(count)]
    wl = [rng.choice([-1, -1, 1]) if r == 0 else -1 for r in wr]
    lq = [1 if a == 1 else n for a, n in zip(wl, lq)]
    lk = [max(n, m) if a == 1 else m for a, n, m in zip(wl, lq, lk)]
    wl = [-1 if a == 1 else a for a in wl]
    q0 = sorted(rng.sample(range(nq - 10), count))
    k0 = [rng.randint(0, nq - 10) for _ in range(count)]
    cu = lambda xs: torch.tensor([0] + list(torch.tensor(xs).cumsum(0)))  # noqa: E731
    return Segments(cu(lq), cu(lk), torch.tensor(wl), torch.tensor(wr), torch.tensor(q0), torch.tensor(k0))


def _expected(segs, b, nq, nk):
    """Per window class in (wl, wr) order: every batch row in turn, each segment in order."""
    out = []
    for wl, wr in sorted({(int(a), int(c)) for a, c in zip(segs.wl, segs.wr)}):
        ids = [t for t in range(len(segs)) if (int(segs.wl[t]), int(segs.wr[t])) == (wl, wr)]
        q_rows, k_rows, cu_q, cu_k = [], [], [0], [0]
        for i in range(b):
            for t in ids:
                a, n = int(segs.q_start[t]), int(segs.lq[t])
                c, m = int(segs.k_start[t]), int(segs.lk[t])
                q_rows += [i * nq + x for x in range(a, a + n)]
                k_rows += [i * nk + y for y in range(c, c + m)]
                cu_q.append(cu_q[-1] + n)
                cu_k.append(cu_k[-1] + m)
        max_q = max(int(segs.lq[t]) for t in ids)
        max_k = max(int(segs.lk[t]) for t in ids)
        out.append((wl, wr, q_rows, cu_q, max_q, k_rows, cu_k, max(max_q, max_k), len(q_rows)))
    return out


def _rows(span, slot):
    """A group's rows: a span (first, count) or gathered ones, never both."""
    assert (span is None) != (slot is None)
    return list(range(span[0], span[0] + span[1])) if span is not None else slot.t.tolist()


def _got(program):
    return [(g.wl, g.wr, _rows(g.q_span, g.q_rows), g.cu_q.t.tolist(), g.max_q, _rows(g.k_span, g.k_rows),
             g.cu_k.t.tolist(), g.max_k, g.total_q) for g in program.groups]


def test_every_call_of_a_plan_at_once():
    rng = random.Random(7)
    for b in (1, 2):
        calls = [_call(rng, rng.randint(1, 12), 200) for _ in range(9)]
        # a striped row's call: every document back to back, so its rows are one range (a span)
        cu = torch.tensor([0, 5, 12, 20])
        calls.append(Segments(cu, cu, torch.full((3,), -1), torch.zeros(3, dtype=torch.int64)))
        arena = Arena()
        programs = native_programs(calls, b, 200, 210, arena)
        assert len(programs) == len(calls)
        for segs, program in zip(calls, programs):
            assert _got(program) == _expected(segs, b, 200, 210)
        assert all(g.cu_q.t.dtype == torch.int32 for p in programs for g in p.groups)
        # packed into one buffer and placed (the device path's packing, forced on the CPU): the
        # groups' views point into the placed buffer and still hold the same values
        arena.place("cpu", force=True)
        assert arena.copies == 1
        storages = {s.t.untyped_storage().data_ptr() for p in programs for g in p.groups
                    for s in (g.q_rows, g.cu_q, g.k_rows, g.cu_k) if s is not None}
        assert len(storages) == 1
        spans = [g.q_span is not None for p in programs for g in p.groups]
        assert not all(spans) and any(spans) == (b == 1)
        # two batch rows of 200: rows 0..19 and 200..219 are no one range
        assert programs[-1].groups[0].q_span == ((0, 20) if b == 1 else None)
        for segs, program in zip(calls, programs):
            assert _got(program) == _expected(segs, b, 200, 210)


def _visible(lq, lk, wl, wr):
    """The (query, key) pairs a bottom-right aligned window shows in one segment."""
    sh = lk - lq
    return {(x, y) for x in range(lq) for y in range(lk)
            if (wl < 0 or y >= x + sh - wl) and (wr < 0 or y <= x + sh + wr)}


def _pairs_of_segments(segs, b, nq, nk):
    out = set()
    for i in range(b):
        for t in range(len(segs)):
            q0, k0 = int(segs.q_start[t]), int(segs.k_start[t])
            for x, y in _visible(int(segs.lq[t]), int(segs.lk[t]), int(segs.wl[t]), int(segs.wr[t])):
                out.add((i * nq + q0 + x, i * nk + k0 + y))
    return out


def _pairs_of_program(program):
    """Every (query row, key row) a program's launches show, and how many launches; asserts that a
    launch's query rows are distinct (its merge adds by row) and no pair is shown twice."""
    out = []
    for g in program.groups:
        q, k = _rows(g.q_span, g.q_rows), _rows(g.k_span, g.k_rows)
        for a, n in (g.parts or ((0, len(q)),)):
            assert len(set(q[a:a + n])) == n, ("a merge with a query row twice", g.wl, g.wr)
        assert sum(n for _, n in g.parts) in (0, len(q))
        cq, ck = g.cu_q.t.tolist(), g.cu_k.t.tolist()
        for t in range(len(cq) - 1):
            for x, y in _visible(cq[t + 1] - cq[t], ck[t + 1] - ck[t], g.wl, g.wr):
                out.append((q[cq[t] + x], k[ck[t] + y]))
    assert len(out) == len(set(out)), "a score entry shown twice"
    return set(out), len(program.groups)


def test_windows_fold_into_the_causal_and_full_classes():
    """Window edges ``(wl >= 0, -1)`` and causal bands ``(wl >= 0, 0)`` at offsets of their own (a
    windowed packed row's) run in the causal and full launches a call has anyway: the same score
    entries, each once, a launch's query rows distinct within each merge, at most 2 launches."""
    rng = random.Random(11)
    for trial in range(60):
        count, nq, nk = rng.randint(1, 10), 120, 130
        lq = [rng.randint(1, 12) for _ in range(count)]
        lk = [rng.randint(1, 12) for _ in range(count)]
        wr = [rng.choice([-1, -1, 0, 0]) for _ in range(count)]
        wl = [rng.choice([-1, 0, 1, 2, 5, 9, 15, 40]) for _ in wr]
        lk = [max(m, n) if r == 0 and a >= 0 else m for m, n, r, a in zip(lk, lq, wr, wl)]  # bands see a key
        q0, at = [], 0
        for n in lq:  # distinct query rows, in order
            at += rng.randint(0, 3)
            q0.append(at)
            at += n
        k0 = [rng.randint(0, nk - 12) for _ in range(count)]
        cu = lambda xs: torch.tensor([0] + list(torch.tensor(xs).cumsum(0)))  # noqa: E731
        segs = Segments(cu(lq), cu(lk), torch.tensor(wl), torch.tensor(wr), torch.tensor(q0), torch.tensor(k0))
        for b in (1, 2):
            program = native_programs([segs], b, nq, nk, Arena())[0]
            got, launches = _pairs_of_program(program)
            assert got == _pairs_of_segments(segs, b, nq, nk), (trial, b)
            assert launches <= 2, (trial, [(g.wl, g.wr) for g in program.groups])


def test_ranges_forwards_and_backwards_match_written_out_ranges():
    from striped_sp.kernels.segments import _ranges

    gen = torch.Generator().manual_seed(3)
    for _ in range(300):
        count = int(torch.randint(1, 40, (1,), generator=gen))
        lens = torch.randint(0, 6, (count,), generator=gen)
        starts = torch.randint(0, 100, (count,), generator=gen)
        back = torch.rand(count, generator=gen) < 0.5
        expected = [torch.arange(s, s + n).flip(0) if r else torch.arange(s, s + n)
                    for s, n, r in zip(starts.tolist(), lens.tolist(), back.tolist())]
        expected = torch.cat(expected + [torch.zeros(0, dtype=torch.int64)])
        assert torch.equal(_ranges(starts, lens, back), expected)
        assert torch.equal(_ranges(starts, lens), torch.cat([torch.arange(s, s + n) for s, n in
                                                             zip(starts.tolist(), lens.tolist())] + [expected[:0]]))
