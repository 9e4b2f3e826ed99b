"""The default ``layout="striped"`` (issue 36): per packed batch the striped plan the cost model
predicts fastest, the same for the data (``shard`` / ``positions``) and the ring; stripes of 1 on rows
without documents; any stripe size given pins it; the plan records the choice and the log says it.

References: float64 attention on the full row (tests/support/reference.py) and positions written out
by hand (``r, r + N, ...`` for stripes of 1), never the module under test at CP = 1."""

from __future__ import annotations

import logging

import pytest
import torch

from reference import reference_attention
from seeds import seed_for
import striped_sp
from striped_sp.engine import local
from striped_sp.plan import search
from striped_sp.plan.striped_layout import Striped
from striped_sp.plan.layouts import LAYOUTS, get_layout

pytestmark = pytest.mark.dist

# three rows of 1024 tokens whose searched plans differ at N = 2 (the table's CPU model):
# stripes of 1 with short documents whole, per-document stripes, stripes of 64 with documents whole
ROWS = {
    "short": (0, 40, 100, 230, 300, 420, 500, 610, 700, 800, 880, 1024),
    "long": (0, 30, 1000, 1024),
    "mixed": (0, 5, 17, 200, 420, 800, 1024),
}
SEQ, N = 1024, 2


def _explicit(bounds) -> dict:
    """The searched configuration of ``bounds`` as explicit layout parameters."""
    return search.search(bounds, N, "cpu")[0].layout_params


def test_the_default_is_the_search_and_parameters_pin_it():
    default = get_layout("striped")
    assert default is LAYOUTS["striped"] and default.key == "striped" and default.stripe_size == "auto"
    assert get_layout(default.key) is default
    pinned = get_layout("striped", stripe_size=1)
    assert pinned.key == "striped:stripe=1" and pinned.stripe_size == 1 and not pinned.places_documents
    assert get_layout(pinned.key).key == "striped:stripe=1"
    # a placement alone keeps stripes of 1, as before the default changed
    placed = get_layout("striped:place=64")
    assert (placed.stripe_size, placed.doc_placement, placed.key) == (1, 64, "striped:place=64")
    assert get_layout(default, doc_placement=64).key == "striped:place=64"
    assert get_layout("striped:stripe=auto").key == "striped:stripe=auto"  # the same plan, as spelled


def test_the_default_resolves_per_batch_to_the_searched_plan():
    choices = {name: _explicit(bounds) for name, bounds in ROWS.items()}
    assert len({tuple(c.values()) for c in choices.values()}) == 3, choices  # one choice per row
    for name, bounds in ROWS.items():
        for r in range(N):
            got = striped_sp.positions(SEQ, N, r, "striped", cu_seqlens=list(bounds))
            want = striped_sp.positions(SEQ, N, r, Striped(**choices[name]), cu_seqlens=list(bounds))
            assert torch.equal(got, want), (name, r, choices[name])
        # and not stripes of 1 over every document (what the default was)
        assert not torch.equal(striped_sp.positions(SEQ, N, 0, "striped", cu_seqlens=list(bounds)),
                               torch.arange(0, SEQ, N)), name


def test_a_stripe_size_pins_the_layout_on_packed_rows():
    for bounds in ROWS.values():
        for r in range(N):
            got = striped_sp.positions(SEQ, N, r, "striped", cu_seqlens=list(bounds), stripe_size=1)
            assert torch.equal(got, torch.arange(r, SEQ, N))
            got = striped_sp.positions(SEQ, N, r, "striped:stripe=64", cu_seqlens=list(bounds))
            assert torch.equal(got, (torch.arange(0, SEQ, 64)[r::N, None] + torch.arange(64)).flatten())


def test_rows_without_documents_run_the_dense_plans_of_the_faster_order():
    """On a row of one document the default runs, by the cost model, zigzag's order (2N stripes of S / 2N
    mirrored) with zigzag's dense block plans, or the paper's stripes of 1 with theirs: the same tokens and
    calls as the layout pinned to that order; ``striped:stripe=1`` stays pinned."""
    from striped_sp.plan.dense_choice import dense_choice

    default, pinned = get_layout("striped"), get_layout("striped:stripe=1")
    assert pinned.dense_plans and pinned.strict_block and pinned.stride(N) == N
    for r in range(N):
        assert torch.equal(striped_sp.positions(SEQ, N, r, "striped:stripe=1"), torch.arange(r, SEQ, N))
    stripe, one, zig = dense_choice(SEQ, N, "cpu")
    assert stripe == ("doc" if zig.ms <= one.ms else 1) and zig.ms < one.ms  # the CPU kernel: zigzag's order
    same = "zigzag" if stripe == "doc" else "striped:stripe=1"
    for r in range(N):
        assert torch.equal(striped_sp.positions(SEQ, N, r, "striped"), striped_sp.positions(SEQ, N, r, same))
    plans = [striped_sp.prepare_plans(SEQ, world_size=N, rank=r, layout="striped") for r in range(N)]
    old = [striped_sp.prepare_plans(SEQ, world_size=N, rank=r, layout=same) for r in range(N)]
    for p, o in zip(plans, old):
        assert not p.masked and p.calls == o.calls and p.entries == o.entries
        assert "zigzag's order" in p.decision and "stripes of 1" in p.decision
    # a row that does not split into 2N equal stripes keeps stripes of 1
    assert dense_choice(2 * N + N, N, "cpu")[0] == 1
    assert torch.equal(striped_sp.positions(3 * N, N, 1, "striped"), torch.arange(1, 3 * N, N))


@pytest.mark.parametrize("row", sorted(ROWS))
def test_the_default_is_exact_on_packed_rows(row):
    """Through the public API (shard, the ring on N simulated ranks, unshard), against float64: if the
    data and the ring resolved the default differently, tokens would sit where the ring does not expect
    them.  The plan of every rank records the same searched choice."""
    bounds = list(ROWS[row])
    gen = torch.Generator().manual_seed(seed_for(f"default-striped-{row}"))
    q, do = (torch.randn(1, SEQ, 4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, SEQ, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, 8 ** -0.5, bounds)
    (ref * do).sum().backward()
    sim = local.simulate(q, k, v, N, do, backend="torch", layout="striped", cu_seqlens=bounds)
    for what, got, want in (("out", sim.out, ref), ("dq", sim.dq, qr.grad), ("dk", sim.dk, kr.grad),
                            ("dv", sim.dv, vr.grad)):
        err = (got - want.detach()).abs().max().item() / max(1.0, want.abs().max().item())
        assert err < 1e-10, (row, what, err)
    chosen = search.search(tuple(bounds), N, "cpu")[0]
    for plan in sim.plans[0]:
        assert plan.decision.startswith("searched") and f"stripe_size={chosen.stripe_size!r}" in plan.decision
        assert f"whole_max={chosen.whole_max}" in plan.decision


def test_the_plan_and_the_debug_log_say_what_was_chosen(caplog):
    bounds = (0, 7, 90, 333, 512, 700, 1024)  # a row no other test places (the log comes once per row)
    search._placed_runs.cache_clear()
    with caplog.at_level(logging.DEBUG, logger="striped_sp.plan.search"):
        plan = striped_sp.prepare_plans(SEQ, world_size=N, rank=0, layout="striped", cu_seqlens=list(bounds))
    chosen = search.search(bounds, N, "cpu")[0]
    lines = [r.getMessage() for r in caplog.records if r.name == "striped_sp.plan.search"]
    assert len(lines) == 1 and f"stripe_size={chosen.stripe_size!r}" in lines[0] and "predicted" in lines[0]
    assert plan.decision in lines[0] and "next " in plan.decision
    pinned = striped_sp.prepare_plans(SEQ, world_size=N, rank=0, layout="striped:stripe=1", cu_seqlens=list(bounds))
    assert pinned.decision.startswith("pinned: stripes of 1")
    assert striped_sp.prepare_plans(SEQ, world_size=N, rank=0, layout="zigzag").decision is None


def test_the_decision_names_zigzag_beside_the_chosen_plan(monkeypatch):
    """The decision line names zigzag's predicted time beside the plan chosen (the striped family holds
    zigzag's order unpadded: per-document stripes, mirrored stripes); the plan records the line, and the
    layout is the striped search's."""
    bounds = (0, 11, 500, 1024)
    line = search.decision(bounds, N, "auto", "auto", "cpu")
    assert "searched" in line and "zigzag (its mirrored order on documents padded to 2N)" in line
    fast = search.Prediction("zigzag", 0, 1e-3, 2, (0.0, 0.0), (0, 0))
    monkeypatch.setattr(search, "predict_zigzag", lambda *a, **k: fast)
    line = search.decision(bounds, N, "auto", "auto", "cpu")
    assert "zigzag (its mirrored order on documents padded to 2N) 0.00 ms" in line
    plan = striped_sp.prepare_plans(SEQ, world_size=N, rank=0, layout="striped", cu_seqlens=list(bounds))
    assert plan.decision == line  # the plan records it; its layout is still the striped search's
    assert torch.equal(striped_sp.positions(SEQ, N, 0, "striped", cu_seqlens=list(bounds)),
                       striped_sp.positions(SEQ, N, 0, Striped(**_explicit(bounds)), cu_seqlens=list(bounds)))