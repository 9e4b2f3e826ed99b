"""The hierarchical-CP model (`striped-sp bench hier`): valid splits, limits, and the CLI."""

import json

from striped_sp.bench.hier import HierConfig, model_records, predict, splits
from striped_sp.cli import main


def test_splits_follow_the_engine_rules():
    assert splits(8, 32, 8) == [1, 2, 4, 8]
    assert splits(16, 32, 8) == [1, 2, 4, 8, 16]      # 16 kv slots: each kv head replicated twice
    assert splits(12, 6, 6) == [1, 2, 3, 6]           # u must divide the heads
    assert splits(8, 8, 3) == [1]                     # 3 kv heads neither divide nor are divided by 2


def test_model_limits():
    fast = HierConfig(intra_gbps=1e9, inter_gbps=1e9)
    recs = [predict(fast, 64, u) for u in splits(64, 32, 8)]
    assert max(r["ms"] for r in recs) - min(r["ms"] for r in recs) < 1e-3  # free links: compute only
    slow = HierConfig(tokens_per_rank=1024, inter_gbps=1.0)  # a crawling inter-node link
    by_u = {r["ulysses"]: r for r in (predict(slow, 16, u) for u in splits(16, 32, 8))}
    assert by_u[8]["ms"] < by_u[1]["ms"]   # Ulysses over the node, fewer slow ring hops
    assert by_u[16]["a2a_link"] == "inter" and by_u[8]["a2a_link"] == "intra"
    best = [r for r in model_records(slow) if r["best"]]
    assert len(best) == len(slow.world_sizes)


def test_cli_prints_and_writes(tmp_path, capsys):
    path, png = tmp_path / "hier.json", tmp_path / "hier.png"
    assert main(["bench", "hier", "--world-sizes", "8,16", "--tokens-per-rank", "4096", "--json", str(path),
                 "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000
    out = capsys.readouterr().out
    assert out.count("<- best") == 2 and "predicted" in out
    recs = json.loads(path.read_text())
    assert {r["world_size"] for r in recs} == {8, 16} and sum(r["best"] for r in recs) == 2
