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
