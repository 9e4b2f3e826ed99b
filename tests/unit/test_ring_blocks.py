"""A ring's blocks built all at once (:func:`ring_plans`: every step in one tensor pass) against
the same blocks built one at a time (:func:`block_plan`, whose coverage test_masks checks against
the global mask): the same calls, segments and entries, for every layout, parameter, rank and
mask; every rank's shared rows at once against :func:`shared_rows` rank by rank."""

import random

import pytest
import torch

from striped_sp.plan.layouts import get_layout
from striped_sp.plan.masks import block_plan, make_mask, ring_plans, shared_rows
from striped_sp.plan.ring_blocks import all_shared_rows

LAYOUTS = ["contiguous", "zigzag", "striped", "striped:stripe=4", "striped:stripe=doc", "striped:place=auto",
           "striped:place=16", "striped:stripe=auto"]


def _row(rng, layout, n):
    """A packed row the layout takes: zigzag's documents padded to multiples of 2N, stripe=4's row
    a multiple of 4N; with a window or none, causal or not."""
    unit = 2 * n if layout == "zigzag" else 1
    row_unit = 4 * n if layout == "striped:stripe=4" else unit if layout == "zigzag" else n
    seq = rng.randint(2, 24) * row_unit
    docs = seq // unit
    cuts = sorted(rng.sample(range(1, docs), rng.randint(0, min(docs - 1, 9)))) if docs > 1 else []
    bounds = [0] + [c * unit for c in cuts] + [seq]
    causal = rng.random() < 0.75
    left = rng.choice([-1, -1, 0, 2, 5, 20])
    right = 0 if causal else rng.choice([-1, 0, 3])
    return make_mask(seq, n, get_layout(layout), bounds, (left, right), causal)


def _same(a, b):
    fields = ("cu_q", "cu_k", "wl", "wr", "q_start", "k_start")
    return all(torch.equal(getattr(a.segments, f), getattr(b.segments, f)) for f in fields) and a.entries == b.entries


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_ring_blocks_equal_block_plans(layout, n):
    rng = random.Random(hash((layout, n)) % 10**6)
    lay = get_layout(layout)
    for _ in range(6):
        try:
            spec = _row(rng, layout, n)
        except ValueError:  # a row this layout refuses (documents that cannot fill the ranks)
            continue
        for rank in range(n):
            steps = rng.choice([n, max(1, n - 1)])
            got = ring_plans(lay, spec, n, rank, steps)
            want = [block_plan(lay, spec, n, rank, (rank - t) % n) for t in range(steps)]
            assert len(got) == len(want)
            for t, (g, w) in enumerate(zip(got, want)):
                assert len(g) == len(w) and all(_same(a, b) for a, b in zip(g, w)), (layout, n, rank, t, spec)
        assert all_shared_rows(lay, spec, n) == tuple(shared_rows(lay, spec, n, r) for r in range(n)), (layout, spec)


@pytest.mark.parametrize("base", ["striped", "zigzag", "striped:stripe=doc"])
def test_ring_blocks_of_a_grouped_layout(base):
    """The outer ring of hierarchical CP (Ulysses groups of 2): members' runs one after another."""
    from striped_sp.plan.grouped import GroupedLayout

    rng = random.Random(len(base))
    for r in (1, 2, 3):
        lay = GroupedLayout(get_layout(base), 2)
        for _ in range(4):
            try:
                spec = _row(rng, base, 2 * r)
            except ValueError:
                continue
            for rank in range(r):
                got = ring_plans(lay, spec, r, rank)
                want = [block_plan(lay, spec, r, rank, (rank - t) % r) for t in range(r)]
                for g, w in zip(got, want):
                    assert len(g) == len(w) and all(_same(a, b) for a, b in zip(g, w)), (base, r, rank, spec)
            assert all_shared_rows(lay, spec, r) == tuple(shared_rows(lay, spec, r, k) for k in range(r))


def test_shared_rows_of_one_token_documents():
    """One token per rank, each its own document: a run of one token (of any stride) is a whole
    document, so no rank shares a row."""
    spec = make_mask(4, 4, get_layout("striped"), [0, 1, 2, 3, 4])
    lay = get_layout("striped")
    assert all_shared_rows(lay, spec, 4) == tuple(shared_rows(lay, spec, 4, r) for r in range(4)) == (0, 0, 0, 0)


@pytest.mark.parametrize("layout", ["striped", "zigzag", "striped:stripe=doc"])
def test_predicted_cost_of_all_calls_at_once(layout):
    """A plan's predicted time per step, priced in one pass, equals its calls priced one by one."""
    from striped_sp.plan.cost import COST_MODELS
    from striped_sp.plan.ring_plan import _predicted_ms, build_host_plan

    rng = random.Random(3)
    n = 4
    spec = _row(rng, layout, n)
    host = build_host_plan(get_layout(layout), spec, spec.causal, n, 1, spec.seq_len // n)
    model = COST_MODELS["cpu"]
    want = [sum(model.segments_ns(c.segments) for c in step) / 1e6 for step in host.calls]
    assert _predicted_ms(host, model) == pytest.approx(want, rel=1e-12)
    assert any(want)


@pytest.mark.parametrize("layout, steps_calls", [("striped:stripe=4", 1), ("zigzag", 1)])
def test_key_pieces_of_a_document_coalesce(layout, steps_calls):
    """One long document: a query stripe sees every key stripe of the source before it whole, and
    those stripes lie back to back in the source's rows, so each query stripe is one segment
    (keys: the run of stripes) and each step one call; zigzag's two chunks likewise.  With a left
    window the earlier keys are cut, and nothing coalesces."""
    n = 4
    lay = get_layout(layout)
    spec = make_mask(512, n, lay, [0, 512])
    for rank in range(n):
        for t, calls in enumerate(ring_plans(lay, spec, n, rank)):
            assert len(calls) <= steps_calls, (layout, rank, t, len(calls))
            if calls and layout != "zigzag":  # one segment per query stripe that sees a key
                assert len(calls[0].segments) <= 512 // n // 4
    windowed = make_mask(512, n, lay, [0, 512], (100, 0))
    assert max(len(c) for r in range(n) for c in ring_plans(lay, windowed, n, r)) > 1
