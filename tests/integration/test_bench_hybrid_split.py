"""``striped-sp bench hybrid-split`` smoke test: 2 gloo ranks, tiny shapes (speed is never asserted).

The table's keys are there, every time and memory peak is positive, and the bytes a rank sends equal
what the split form must move, computed here from the shapes: the short convolution sends ``B * x``
(all ``C`` channels of its ``S/N`` tokens) and gets its conv output back, each way once forward and
once backward; ``(N - 1) / N`` of each leaves the rank."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

N, S, HIDDEN = 2, 64, 32


def test_split_bench_table_and_bytes(tmp_path):
    from striped_sp.bench.hybrid_split import COLUMNS
    from striped_sp.cli import main

    path = tmp_path / "split.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "hybrid-split", "--kinds", "short_conv", "--world-sizes", str(N), "--seq-lens", str(S),
                     "--hidden", str(HIDDEN), "--reps", "1", "--json", str(path)]) == 0
    recs, text = json.loads(path.read_text()), out.getvalue()
    assert len(recs) == 1
    r = recs[0]
    for key, head in COLUMNS:
        assert key in r and head in text, key
    assert (r["kind"], r["world_size"], r["seq_len"], r["hidden"]) == ("short_conv", N, S, HIDDEN)
    assert r["split_bytes"] == 4 * (S // N) * HIDDEN * 4 * (N - 1) // N
    assert r["gather_bytes"] == 3 * (N - 1) * (S // N) * HIDDEN * 4
    for mode in ("split", "gathered", "local", "sp1"):
        assert r[f"{mode}_cpu_ms"] > 0 and r[f"{mode}_peak_mib"] > 0, mode


def test_predicted_gdn_bytes_from_the_shapes():
    """Qwen3-Next-80B's gated delta net at 128k tokens: per rank, 8 ranks, bf16 (hand-computed here).
    Split: 16384 tokens x (8 x (2 key heads x 2 x 128 + 4 value heads x 130) in + 32 x 128 out) x 2 B, forward
    and backward, 7/8 leaving; at 32 ranks each rank reads one key head that two ranks share (sent twice)."""
    from striped_sp.bench.hybrid_split import QWEN3_NEXT, predict_gdn

    r = predict_gdn(131072, 8, **QWEN3_NEXT)
    assert r["split_bytes"] == 2 * 16384 * (8 * (2 * 2 * 128 + 4 * 130) + 32 * 128) * 2 * 7 / 8
    assert r["gathered_bytes"] == 2 * 131072 * 2048 * 2 * 7 / 8
    assert r["ring_bytes"] == 7 * 2 * 16384 * 2 * 256 * 2 * 2 + 8 * 2 * 16384 * 2 * 256 * 4
    assert r["gathered_act_bytes"] == 131072 * (2 * 16 * 128 + 32 * 130) * 2
    r32 = predict_gdn(131072, 32, **QWEN3_NEXT)
    assert r32["split_bytes"] == 2 * 4096 * (32 * (2 * 1 * 128 + 1 * 130) + 32 * 128) * 2 * 31 / 32


def test_model_bench_sp1_against_split_exact(tmp_path):
    """``--model``: the tiny hybrid's SP=1 (the plain model) and SP=2 (split, gathered) rows, exact."""
    from striped_sp.bench.hybrid_model import COLUMNS
    from striped_sp.cli import main

    path = tmp_path / "model.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "hybrid-split", "--model", "--kinds", "short_conv", "--world-sizes", str(N),
                     "--seq-lens", str(S), "--hidden", "64", "--reps", "1", "--json", str(path)]) == 0
    (r,), text = json.loads(path.read_text()), out.getvalue()
    for key, head in COLUMNS:
        assert key in r and head in text, key
    assert r["mixers"].startswith("mixers: 3 split (short convolution: split "), r["mixers"]  # the cost model's pick
    assert r["split_loss_rel_diff"] < 1e-5 and r["gathered_loss_rel_diff"] < 1e-5, r
    assert r["split_grad_rel_diff"] < 1e-4, r
    for mode in ("sp1", "split", "gathered"):
        assert r[f"{mode}_cpu_ms"] > 0 and r[f"{mode}_peak_mib"] > 0, mode
