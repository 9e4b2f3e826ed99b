"""``striped-sp bench hybrid`` smoke test: 2 gloo ranks, tiny shapes (speed is never asserted).

The table's keys are there, every time is positive, and the byte counts equal the formulas
(computed from the shapes, per rank): the gather's all-gather and reduce-scatter ``(N-1)/N x S x C x e``
(gloo's all-reduce twice that); the ring sends K and V ``N-1`` times forward, and backward K and V
``N-1`` times and the fp32 dK / dV accumulators ``N`` times (the last hop brings them home).
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

pytest.importorskip("transformers")

pytestmark = pytest.mark.integration

N, S, HEADS, HEAD_DIM = 2, 64, 2, 8


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from striped_sp.cli import main

    path = tmp_path_factory.mktemp("hybrid") / "hybrid.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "hybrid", "--world-sizes", str(N), "--seq-lens", str(S), "--heads", str(HEADS),
                     "--head-dim", str(HEAD_DIM), "--reps", "1", "--json", str(path)]) == 0
    return json.loads(path.read_text()), out.getvalue()


def test_table_keys_and_bytes(run):
    from striped_sp.bench.hybrid_cost import COLUMNS, gather_bytes

    recs, text = run
    assert len(recs) == 1
    r = recs[0]
    for key, head in COLUMNS:
        assert key in r and head in text
    assert (r["world_size"], r["seq_len"], r["hidden"], r["mixer"]) == (N, S, HEADS * HEAD_DIM, "short_conv")
    e, c, s = 4, HEADS * HEAD_DIM, S // N
    assert r["gather_fwd_bytes"] == r["gather_bwd_bytes"] == (N - 1) * s * c * e
    assert r["gather_bwd_bytes_gloo"] == 2 * (N - 1) * s * c * e
    assert gather_bytes(S, N, c, e) == {k: r[k] for k in ("gather_fwd_bytes", "gather_bwd_bytes",
                                                          "gather_bwd_bytes_gloo")}
    kv = s * HEADS * HEAD_DIM  # one K (or V) block of this rank
    assert r["ring_fwd_bytes"] == (N - 1) * 2 * kv * e
    assert r["ring_bwd_bytes"] == (N - 1) * 2 * kv * e + N * 2 * kv * 4
    for key in ("gather_ms", "gather_cpu_ms", "ring_ms", "ring_cpu_ms", "mixer_whole_ms", "mixer_local_ms"):
        assert r[key] > 0, key


def test_train_hf_model_option_and_refusals():
    """``bench train --hf-model``: llama by default; lfm2 with packed or window rows refused by name."""
    from striped_sp.bench.train import TrainConfig, _check, config_of
    from striped_sp.cli import build_parser

    args = build_parser().parse_args(["bench", "train"])
    assert args.hf_model == "llama" and config_of(args).hf_model == "llama"
    with pytest.raises(ValueError, match="--hf-model lfm2 runs dense rows only.*--rows dense"):
        _check(TrainConfig(models=("hf",), kinds=("dense", "packed"), hf_model="lfm2"))
    _check(TrainConfig(models=("hf",), kinds=("dense",), hf_model="lfm2"))
    with pytest.raises(ValueError, match="--hf-model qwen3_next runs dense rows only"):
        _check(TrainConfig(models=("hf",), kinds=("dense", "window"), hf_model="qwen3_next"))
    assert build_parser().parse_args(["bench", "train", "--hf-model", "qwen3_next"]).hf_model == "qwen3_next"


def test_train_lfm2_runs_and_refuses_ulysses_by_name(tmp_path):
    """LFM2 (conv / attention) at SP=2: every layout trains with the same losses; no Ulysses column."""
    pytest.importorskip("deepspeed")
    from striped_sp.cli import main

    path = tmp_path / "train.json"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["bench", "train", "--models", "hf", "--hf-model", "lfm2", "--rows", "dense", "--seq-lens", "64",
                     "--layers", "2", "--hidden", "32", "--ffn-hidden", "64", "--heads", "4", "--kv-heads", "2",
                     "--head-dim", "8", "--vocab", "96", "--rounds", "2", "--init-std", "0.5", "--no-progress",
                     "--layouts", "striped,zigzag,contiguous", "--json", str(path)]) == 0
    recs = json.loads(path.read_text())
    assert {r["impl"] for r in recs} == {"striped", "zigzag", "contiguous", "ulysses"}
    assert all(r["hf_model"] == "lfm2" for r in recs)
    for r in recs:
        if r["impl"] == "ulysses":
            assert r["median_ms"] is None
        else:
            assert r["median_ms"] > 0 and r["loss_rel_diff"] < 1e-5, r
    text = out.getvalue()
    assert "hf model: lfm2" in text and "no Ulysses peer for the hybrid lfm2" in text
