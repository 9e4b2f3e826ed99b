"""The benchmark on packed documents and windows: document mixes, the work model against a
brute-force count on the global mask, and smoke tests of balance / sim / run (speed never asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from reference import reference_mask
from striped_sp.bench.docs import packed_row, parse_docs, visible_entries, workload
from striped_sp.bench.work import masked_step_entries
from striped_sp.cli import main
from striped_sp.plan.layouts import LAYOUTS, get_layout


@pytest.mark.parametrize("spec", ["lognormal:median=64,sigma=1.2", "long", "fixed:7"])
def test_packed_rows_are_seeded_and_cover_the_row(spec):
    mix = parse_docs(spec)
    a, b = packed_row(mix, 1000, row=2, seed=3), packed_row(mix, 1000, row=2, seed=3)
    assert a == b and a[0] == 0 and a[-1] == 1000
    assert all(y > x for x, y in zip(a[:-1], a[1:]))
    if spec == "fixed:7":
        assert all(y - x <= 7 for x, y in zip(a[:-1], a[1:]))


@pytest.mark.parametrize("bad", ["lognormal:median=-1", "lognormal:mu=3", "fixed:0", "fixed:x", "uniform"])
def test_bad_docs_spec(bad):
    with pytest.raises(ValueError, match="--docs"):
        parse_docs(bad)


def _brute_force(work):
    """entries[t][r] from the global mask of the layout's (possibly padded) row."""
    lay, n, spec = get_layout(work.layout), work.world_size, work.mask
    visible = reference_mask(spec.seq_len, True, spec.bounds, None if spec.left < 0 else (spec.left, 0))
    pos = [lay.positions(spec.seq_len, n, r, spec.bounds) for r in range(n)]
    return [[int(visible[pos[r]][:, pos[(r - t) % n]].sum()) for r in range(n)] for t in range(n)]


@pytest.mark.parametrize("layout", sorted(LAYOUTS) + ["striped:stripe=3", "striped:place=auto", "striped:place=6",
                                                    "striped:stripe=2,place=5"])
@pytest.mark.parametrize("docs, window", [("lognormal:median=20,sigma=1.0", None), (None, 9),
                                          ("fixed:5", 3), ("long", 30)])
def test_masked_work_model_matches_brute_force(layout, docs, window):
    for n in (1, 3, 4):
        work = workload(layout, n, 24, docs, window, seed=n)
        assert masked_step_entries(work) == _brute_force(work)
        if layout != "zigzag" or docs is None:
            assert work.padding_tokens == 0
            assert visible_entries(work.mask) == int(reference_mask(
                work.mask.seq_len, True, work.mask.bounds, (window, 0) if window else None).sum())


def test_masked_balance_and_sim_smoke(tmp_path, capsys):
    path = tmp_path / "b.json"
    assert main(["bench", "balance", "--world-sizes", "4", "--tokens-per-rank", "64", "--docs",
                 "lognormal:median=32,sigma=1.2", "--window", "16", "--json", str(path),
                 "--plot", str(tmp_path / "b.png")]) == 0
    recs = json.loads(path.read_text())
    assert {r["layout"] for r in recs} == {"striped", "zigzag", "contiguous"}
    for r in recs:
        assert r["docs"] == "lognormal:median=32,sigma=1.2" and r["window"] == 16
        assert r["critical_path_over_ideal"] >= 1.0 - 1e-9
    assert next(r for r in recs if r["layout"] == "zigzag")["padding_tokens"] > 0
    assert "critical/ideal" in capsys.readouterr().out
    assert main(["bench", "sim", "--world-sizes", "2", "--tokens-per-rank", "40", "--heads", "2",
                 "--head-dim", "8", "--reps", "1", "--docs", "fixed:9", "--window", "5", "--device", "cpu",
                 "--no-progress", "--json", str(path), "--plot", str(tmp_path / "s.png")]) == 0
    recs = json.loads(path.read_text())
    assert len(recs) == 3 * 3
    for r in recs:
        assert r["critical_path_ms"] > 0 and r["efficiency"] > 0 and r["speedup_vs_zigzag"] > 0
        assert r["docs"] == "fixed:9" and r["window"] == 5
    assert "vs zigzag" in capsys.readouterr().out
    assert main(["bench", "sim", "--world-sizes", "2", "--tokens-per-rank", "40", "--heads", "2",
                 "--head-dim", "8", "--reps", "1", "--docs", "fixed:9", "--device", "cpu", "--no-reference",
                 "--no-progress", "--json", str(path), "--layouts", "striped:place=auto;striped:stripe=4;zigzag"]) == 0
    recs = json.loads(path.read_text())
    placed = [r for r in recs if r["layout"] == "striped:place=auto"]
    assert placed and all(r["plan"].startswith("whole documents <= ") and r["predicted_forward_ms"] > 0
                          for r in placed)
    assert "plan striped:place=auto N=2: whole documents" in capsys.readouterr().out


def test_masked_run_smoke(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["bench", "run", "--world-size", "2", "--tokens-per-rank", "30", "--heads", "2",
                 "--head-dim", "8", "--warmup", "0", "--iters", "1", "--docs", "fixed:7", "--device", "cpu",
                 "--threads", "1", "--no-progress", "--json", str(path)]) == 0
    recs = json.loads(path.read_text())
    ours = [r for r in recs if r["impl"] in LAYOUTS]
    assert len(ours) == 3 and all(r["median_ms"] > 0 and r["docs"] == "fixed:7" for r in ours)
    assert "padding tokens" in capsys.readouterr().out  # zigzag pads documents of 7 to 8
    assert next(r for r in recs if r["impl"] == "zigzag")["padding_tokens"] > 0


def test_masked_sim_refuses_what_it_cannot_honour():
    for extra in (["--batch", "2"], ["--seq-lens", "64"]):
        with pytest.raises(SystemExit):
            main(["bench", "sim", "--world-sizes", "2", "--docs", "fixed:4", "--device", "cpu", "--no-progress", *extra])


def test_masked_sim_runs_every_rank_step(monkeypatch):
    """Every (rank, step) of the masked executor runs, even where ranks share a plan (zigzag, two
    documents of 4N chunks): each rank's varlen calls per run are its plan's programs."""
    import copy
    import dataclasses

    from striped_sp.bench import sim, sim_masked

    cfg = sim.SimConfig(layouts=("zigzag",), world_sizes=(4,), heads=1, head_dim=8, dtype=torch.float32,
                        device=torch.device("cpu"), reps=1, reference=False, progress=False)
    work = workload("zigzag", 4, 16, "fixed:32", None)
    plans = sim.ring_plans(cfg, sim_masked.masked_request("zigzag", work, "fixed:32", None), 4, work.local_len,
                           sim.sim_kernel(cfg))
    assert all(p.masked for p in plans)
    counts, counted = [0] * 4, []
    for r, plan in enumerate(plans):
        kernel = copy.copy(plan.kernel)
        inner = kernel.forward_varlen

        def call(*a, r=r, inner=inner):
            counts[r] += 1
            return inner(*a)

        kernel.forward_varlen = call
        counted.append(dataclasses.replace(plan, kernel=kernel))
    crit = sim.time_rings(cfg, {"z": (counted, sim.random_inputs(cfg, work.local_len, torch.Generator()))},
                          sim.Bar(0, "", False))
    assert counts == [2 * sum(len(step) for step in p.programs) for p in plans] and min(counts) > 0
    assert crit["z"]["forward"] > 0 and crit["z"]["fwd+bwd"] == crit["z"]["forward"] + crit["z"]["backward"]
    records = sim_masked.simulate_masked(cfg, [16], "fixed:32", None)
    assert len(records) == 3 and all(r["critical_path_ms"] > 0 for r in records)
