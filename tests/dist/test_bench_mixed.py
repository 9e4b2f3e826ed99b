"""Mixed local/global models in the benchmark (``--global-every K``) and the plan report of striped
layouts with parameters in balance / sim / run records (speed never asserted)."""

from __future__ import annotations

import json

import pytest

from striped_sp.bench import mixed, sim_masked
from striped_sp.bench.docs import workload
from striped_sp.bench.mixed import check_global_every, combine_layers
from striped_sp.cli import main
from striped_sp.plan.layouts import get_layout
from striped_sp.plan.masks import block_plan


def _rec(layout, ms, p="fwd+bwd", **kw):
    return {"layout": layout, "world_size": 4, "seq_len": 256, "pass": p, "critical_path_ms": ms, **kw}


def test_combine_layers_block_time_and_speedups():
    window = [_rec("striped", 3.0, plan="x"), _rec("zigzag", 5.0), _rec("contiguous", 2.0)]
    glob = [_rec("striped", 7.0, predicted_forward_ms=1.5), _rec("zigzag", 11.0), _rec("contiguous", 13.0)]
    recs = combine_layers(window, glob, [1, 2, 6], "critical_path_ms")
    assert len(recs) == 9
    expect = {"striped": (3.0, 7.0), "zigzag": (5.0, 11.0), "contiguous": (2.0, 13.0)}
    for r in recs:
        k, (w, g) = r["global_every"], expect[r["layout"]]
        block = (k - 1) * w + g  # K-1 window layers and one global layer
        assert r["block_ms"] == pytest.approx(block) and r["critical_path_ms"] == pytest.approx(block)
        assert r["window_layer_ms"] == w and r["global_layer_ms"] == g
        assert r["window_share"] == pytest.approx((k - 1) * w / block)
        zig = (k - 1) * 5.0 + 11.0
        con = (k - 1) * 2.0 + 13.0
        assert r["speedup_vs_zigzag"] == pytest.approx(zig / block)
        assert r["speedup_vs_contiguous"] == pytest.approx(con / block)
    striped6 = next(r for r in recs if r["layout"] == "striped" and r["global_every"] == 6)
    assert striped6["plan"] == "x" and striped6["global_predicted_forward_ms"] == 1.5
    with pytest.raises(ValueError, match="no global-layer record"):
        combine_layers(window, glob[:2], [2], "critical_path_ms")


@pytest.mark.parametrize("ks, window", [([0], 8), ([-2], 8), ([2, 0], 8), ([True], 8), ([], 8), ([2], 0),
                                        ([2], None)])
def test_check_global_every_refuses(ks, window):
    with pytest.raises(ValueError, match="--global-every"):
        check_global_every(ks, window)


def test_cli_refuses_bad_global_every_before_work(monkeypatch, capsys):
    def boom(*a, **kw):
        raise AssertionError("work started")

    monkeypatch.setattr(sim_masked, "simulate_masked", boom)
    monkeypatch.setattr(mixed, "simulate_mixed", boom)
    base = ["bench", "sim", "--world-sizes", "2", "--tokens-per-rank", "16", "--device", "cpu", "--no-progress"]
    for extra, msg in ((["--window", "4", "--global-every", "0"], "positive"),
                       (["--global-every", "2"], "needs --window"),
                       (["--docs", "fixed:4", "--global-every", "3"], "needs --window")):
        with pytest.raises(SystemExit) as e:
            main(base + extra)
        assert e.value.code == 2 and msg in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["bench", "run", "--world-size", "2", "--tokens-per-rank", "16", "--device", "cpu", "--peers", "none",
              "--no-progress", "--global-every", "2"])
    assert e.value.code == 2 and "needs --window" in capsys.readouterr().err


def test_sim_global_every_records(tmp_path, capsys):
    path = tmp_path / "m.json"
    assert main(["bench", "sim", "--world-sizes", "2", "--tokens-per-rank", "48", "--heads", "2", "--head-dim", "8",
                 "--reps", "1", "--window", "12", "--global-every", "2,5", "--device", "cpu", "--no-progress",
                 "--layouts", "striped;striped:stripe=8;zigzag;contiguous", "--json", str(path)]) == 0
    recs = json.loads(path.read_text())
    assert len(recs) == 2 * 3 * 4  # K x pass x layout
    for r in recs:
        k = r["global_every"]
        assert r["window"] == 12 and r["window_layer_ms"] > 0 and r["global_layer_ms"] > 0
        assert r["block_ms"] == pytest.approx((k - 1) * r["window_layer_ms"] + r["global_layer_ms"])
        assert r["speedup_vs_zigzag"] > 0 and r["speedup_vs_contiguous"] > 0
    # the two layer timings are shared by every K
    for lay in ("striped", "striped:stripe=8", "zigzag", "contiguous"):
        two, five = (next(r for r in recs if r["layout"] == lay and r["global_every"] == k and r["pass"] == "forward")
                     for k in (2, 5))
        assert (two["window_layer_ms"], two["global_layer_ms"]) == (five["window_layer_ms"], five["global_layer_ms"])
    stripes = [r for r in recs if r["layout"] == "striped:stripe=8"]
    assert all(r["plan"].startswith("whole documents <= ") and r["global_predicted_forward_ms"] > 0 for r in stripes)
    out = capsys.readouterr().out
    assert "block ms" in out and "window share" in out and "measured global layer forward" in out


def test_balance_reports_plans(tmp_path, capsys):
    path = tmp_path / "b.json"
    assert main(["bench", "balance", "--world-sizes", "4", "--tokens-per-rank", "64", "--docs",
                 "lognormal:median=24,sigma=1.0", "--layouts", "striped;striped:place=auto;striped:stripe=8",
                 "--no-progress", "--json", str(path)]) == 0
    recs = json.loads(path.read_text())
    for r in recs:  # the default too: its per-batch search chose a plan worth naming
        assert r["plan"].startswith("whole documents <= ") and r["predicted_forward_ms"] > 0
        assert r["plan_balance"] >= 1.0 - 1e-9
    out = capsys.readouterr().out
    assert "plan striped:place=auto N=4" in out and "plan striped N=4: whole documents" in out
    # a plain row with stripes runs the masked plans (stripes have no dense ones)
    assert main(["bench", "balance", "--world-sizes", "4", "--tokens-per-rank", "32", "--no-progress",
                 "--layouts", "striped;striped:stripe=8"]) == 0


@pytest.mark.parametrize("world, tpr, docs, layouts", [
    (32, 32, "fixed:32", "striped:stripe=1;striped;striped:place=auto"),  # the plan line once said 1.0000 by 1.9394
    (8, 512, "lognormal:median=300,sigma=1.2", "striped;striped:stripe=1;striped:stripe=doc;striped:stripe=64"),
])
def test_balance_plan_line_agrees_with_the_table(tmp_path, capsys, world, tpr, docs, layouts):
    """A plan line's balance is the critical path over ideal of the plan the table row measures."""
    path = tmp_path / "b.json"
    assert main(["bench", "balance", "--world-sizes", str(world), "--tokens-per-rank", str(tpr), "--docs", docs,
                 "--layouts", layouts, "--no-progress", "--json", str(path)]) == 0
    recs = json.loads(path.read_text())
    assert len(recs) == len(layouts.split(";"))
    lines = {ln.split(": ")[0]: ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("plan ")}
    for r in recs:
        assert r["plan_balance"] == pytest.approx(r["critical_path_over_ideal"], rel=1e-9), r["layout"]
        assert f"balance {r['critical_path_over_ideal']:.4f})" in lines[f"plan {r['layout']} N={world}"]


def test_run_global_every_and_plans(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["bench", "run", "--world-size", "2", "--tokens-per-rank", "32", "--heads", "2", "--head-dim", "8",
                 "--warmup", "0", "--iters", "1", "--docs", "fixed:12", "--window", "6", "--global-every", "3",
                 "--device", "cpu", "--threads", "1", "--no-progress", "--peers", "none", "--layouts",
                 "striped:stripe=8,place=auto;zigzag", "--json", str(path)]) == 0
    recs = json.loads(path.read_text())
    layers = {r["impl"]: r for r in recs if "global_every" not in r}
    assert {"striped:stripe=8,place=auto|global", "zigzag|global", "contiguous|global"} <= set(layers)
    blocks = [r for r in recs if r.get("global_every") == 3]
    assert {r["impl"] for r in blocks} == {"striped:stripe=8,place=auto", "zigzag", "contiguous"}
    for b in blocks:
        w, g = layers[b["impl"]]["median_ms"], layers[b["impl"] + "|global"]["median_ms"]
        assert b["block_ms"] == pytest.approx(2 * w + g) and b["median_ms"] == b["block_ms"]
    st = layers["striped:stripe=8,place=auto|global"]
    assert st["plan"].startswith("whole documents") and st["predicted_forward_ms"] > 0
    assert layers["striped:stripe=8,place=auto"]["predicted_forward_ms"] is None  # windowed: no prediction
    assert "block ms" in capsys.readouterr().out
