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
