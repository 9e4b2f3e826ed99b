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
    wl = [rng.choice([-1, -1, 3]) for _ in range(count)]
    wr = [rng.choice([-1, 0]) for _ in range(count)]
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
