"""A plan's calls are scheduled together (``schedule_steps``): each call's pieces must be exactly
those it gets scheduled alone, however its neighbours' rows and shapes line up with its own."""

from __future__ import annotations

import random

import pytest
import torch

from seeds import seed_for
from striped_sp.kernels.schedule import schedule, schedule_steps
from striped_sp.kernels.segments import Segments

FIELDS = ("q_index", "k_index", "mask", "packs", "cq", "ck", "q_real", "k_real", "strided", "causal")


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _check(calls: list) -> None:
    together = schedule_steps(calls)
    assert len(together) == len(calls)
    for t, (segs, got) in enumerate(zip(calls, together)):
        alone = schedule(segs)
        assert got.direct == alone.direct, t
        assert len(got.batches) == len(alone.batches), (t, len(got.batches), len(alone.batches))
        for i, (x, y) in enumerate(zip(got.batches, alone.batches)):
            for f in FIELDS:
                assert _same(getattr(x, f), getattr(y, f)), (t, i, f)


def _segs(items: list) -> Segments:
    """``items``: ``(q0, lq, k0, lk, wl, wr)`` per segment."""
    cu_q, cu_k = [0], [0]
    for _, lq, _, lk, _, _ in items:
        cu_q.append(cu_q[-1] + lq)
        cu_k.append(cu_k[-1] + lk)
    col = list(zip(*items))
    return Segments(torch.tensor(cu_q), torch.tensor(cu_k), torch.tensor(col[4]), torch.tensor(col[5]),
                    torch.tensor(col[0]), torch.tensor(col[2]))


def _random_call(rng: random.Random) -> Segments:
    items, q, k = [], 0, 0
    for _ in range(rng.randint(1, 40)):
        lq = rng.choice([1, 3, 8, 15, 16, 17, 31, 32, 40, 64, 100, 128, 129, 200, 300])
        lk = lq if rng.random() < 0.6 else rng.choice([lq + 1, lq + 5, lq + 64, 2 * lq + 3])
        wl = -1 if rng.random() < 0.6 else rng.randint(0, 300)
        wr = 0 if rng.random() < 0.8 else rng.choice([-1, 5])
        items.append((q, lq, k + rng.choice([0, 3]), lk, wl, wr))
        q, k = q + lq, k + lk + 3
    return _segs(items)


@pytest.mark.parametrize("trial", range(40))
def test_calls_scheduled_together_get_their_own_schedules(trial):
    rng = random.Random(seed_for(f"schedule-steps-{trial}"))
    _check([_random_call(rng) for _ in range(rng.randint(2, 6))])


@pytest.mark.parametrize("m,step,window", [(32, 32, -1), (48, 50, -1), (16, 16, -1), (64, 67, 7)])
def test_runs_and_packs_do_not_cross_calls(m, step, window):
    """Equal squares (or equal band tiles) whose rows and keys go on from one call into the next
    at the same step, and short documents packed up to a call's end: a run, a class batch or a
    pack spanning two calls would hand one call's rows to the other."""
    lk = m if window < 0 else m + 3
    first = _segs([(i * m, m, 5 + i * step, lk, window, 0) for i in range(6)])
    second = _segs([(i * m, m, 5 + i * step, lk, window, 0) for i in range(6, 12)])
    short = _segs([(i * 7, 7, i * 9, 9, -1, 0) for i in range(20)])
    also_short = _segs([(i * 7, 7, i * 9, 9, -1, 0) for i in range(20, 40)])
    _check([first, second, short, also_short])
    _check([second, first])
