"""``placement.predict``'s balance is the placement's own critical path in score entries
(:func:`striped_sp.plan.placement.table_step_entries`), checked token by token on small rows of
every kind of placement: stripes of 1 and of ``s``, whole, cut and striped documents together."""

from __future__ import annotations

import random

import pytest
import torch

from striped_sp.plan import placement


def _brute(bounds, n, tables):
    """``entries[t, r]`` counted pair by pair: query q on rank r, key k on rank (r - t) mod N, same
    document, k <= q."""
    owner = {}
    for r, t in enumerate(tables):
        for _, first, count, step in t.reshape(-1, 4).tolist():
            for x in range(count):
                owner[first + step * x] = r
    assert sorted(owner) == list(range(bounds[-1]))
    entries = torch.zeros(n, n, dtype=torch.float64)
    for a, b in zip(bounds[:-1], bounds[1:]):
        for q in range(a, b):
            for k in range(a, q + 1):
                entries[(owner[q] - owner[k]) % n, owner[q]] += 1
    return entries


def _rows(seed):
    rng = random.Random(seed)
    for _ in range(40):
        n = rng.choice([1, 2, 3, 4, 5, 8])
        local = rng.choice([8, 12, 16, 24, 32])
        lengths, total = [], n * local
        while sum(lengths) < total:
            lengths.append(min(rng.choice([1, 2, 3, 5, 7, 11, 20, 40, 90]), total - sum(lengths)))
        bounds = [0]
        for x in lengths:
            bounds.append(bounds[-1] + x)
        yield n, tuple(bounds), rng.choice([1, 1, 2, 4]), rng.choice([0, 4, 16, local])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_table_step_entries_counts_every_visible_pair(seed):
    checked = 0
    for n, bounds, stripe, whole_max in _rows(seed):
        try:
            tables, *_ = placement._place(bounds, n, stripe, whole_max)
        except ValueError:  # stripes that cannot fill the ranks evenly
            continue
        got = placement.table_step_entries(bounds, n, tables)
        assert torch.equal(got, _brute(bounds, n, tables)), (n, bounds, stripe, whole_max)
        ideal = sum((b - a) * (b - a + 1) / 2 for a, b in zip(bounds[:-1], bounds[1:])) / n
        balance = placement.predict(bounds, n, stripe, whole_max, "cpu")["balance"]
        assert balance == pytest.approx(float(got.max(1).values.sum()) / ideal, rel=1e-12)
        checked += 1
    assert checked >= 15


def test_short_documents_striped_are_not_an_even_share():
    """32 documents of 32 tokens on 32 ranks, stripes of 1: each document's first token falls on the
    same rank, which runs every step's largest block (the plan line once said 1.0000 here)."""
    bounds = tuple(range(0, 32 * 32 + 1, 32))
    assert placement.predict(bounds, 32, 1, 0, "cpu")["balance"] == pytest.approx(1.9394, abs=1e-4)
    assert placement.predict(bounds, 32, 1, 32, "cpu")["balance"] == pytest.approx(1.0)
