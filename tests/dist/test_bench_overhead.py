"""``striped-sp bench overhead`` on tiny sizes: the per-batch plan time is reported, the CUDA path's
dry run shows no host-to-device copy and no synchronisation per layer after the first (and the
arena's one copy in the first), the counts agree with the plans, and a copy per call is caught."""

from __future__ import annotations

import json

import pytest
import torch

from striped_sp.bench import overhead
from striped_sp.cli import main
from striped_sp.kernels import native

LAYOUTS = "striped;zigzag;striped:stripe=doc"


def _run(tmp_path, capsys, *extra):
    path = tmp_path / "overhead.json"
    assert main(["bench", "overhead", "--world-sizes", "4", "--tokens", "4k", "--window", "256", "--reps", "1",
                 "--no-progress", "--layouts", LAYOUTS, "--json", str(path), *extra]) == 0
    return json.loads(path.read_text()), capsys.readouterr().out


def test_overhead_counts_on_both_paths(tmp_path, capsys):
    recs, out = _run(tmp_path, capsys)
    header = out.splitlines()[[i for i, line in enumerate(out.splitlines()) if line.startswith("layout")][0]]
    for column in ("plan ms", "ops", "kernels", "other ops", "h2d", "syncs", "host ms"):
        assert column in header, column
    configs = 3 * len(overhead.ROWS)  # layouts x rows on the cuda path
    assert "the issue's targets" in out
    assert f"0 synchronisations per layer after the first: met ({configs} of {configs}" in out
    assert f"<= 2 attention kernel launches per forward ring step (every row): met ({configs} of {configs}" in out
    assert {(r["layout"], r["row"], r["path"]) for r in recs} == {
        (lay, row, path) for lay in ("striped", "zigzag", "striped:stripe=doc") for row in overhead.ROWS
        for path in ("cpu", "cuda (dry run)")}
    for r in recs:
        what = (r["layout"], r["row"], r["path"])
        assert r["plan_ms"] > 0 and r["prepare_ms"] > 0 and r["host_ms"] > 0, what
        assert r["ops"] == r["kernel_calls"] + r["other_ops"] and r["kernel_calls"] > 0, what
        assert r["forward_kernel_calls"] == r["planned_forward_launches"], what  # what the plan says, no more
        assert r["h2d_copies"] == 0 and r["syncs"] == 0 and r["data_dependent_ops"] == 0, what
        if r["path"] == "cpu":
            assert r["first_layer_h2d_copies"] == 0, what
        else:  # the first layer places a masked plan on the device with one copy
            assert r["count_device"] == "meta" and r["first_layer_syncs"] == 0
            assert r["first_layer_h2d_copies"] == (1 if r["masked"] else 0), what
            assert r["launches_per_step_group"] <= 2, what
    cuda = {(r["layout"], r["row"]): r for r in recs if r["path"] != "cpu"}
    assert cuda[("striped", "packed")]["launches_per_step_group"] == 1  # one varlen call per window class


def test_a_copy_per_call_is_counted(tmp_path, capsys, monkeypatch):
    """The check bites: a varlen program that copies to the device on every call."""
    forward = native.NativeCall.forward

    def copying(self, kernel, q, *args):
        torch.zeros(2, dtype=torch.int32).to(q.device)  # a host -> device copy per call
        return forward(self, kernel, q, *args)

    monkeypatch.setattr(native.NativeCall, "forward", copying)
    recs, out = _run(tmp_path, capsys, "--rows", "packed", "--paths", "cuda", "--layouts", "striped")
    assert recs[0]["h2d_copies"] == recs[0]["planned_forward_launches"] > 0
    assert "0 host-to-device copies per layer after the first: MISSED (0 of 1" in out


def test_shape_only_attention_lays_out_like_the_kernel_and_goes_away():
    q, k, v = (torch.randn(1, 2, 48, 8) for _ in range(3))
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    want = op(q, k, v, 0.0, True, scale=0.3)
    with overhead.shape_only_attention(overhead.PATH_OPS["cpu"]):
        got = op(q, k, v, 0.0, True, scale=0.3)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.stride() == w.stride() and g.dtype == w.dtype
    again = op(q, k, v, 0.0, True, scale=0.3)  # the real kernel is back
    assert all(torch.equal(a, w) for a, w in zip(again, want))


def test_sizes_parse():
    assert overhead._sizes("128k,1M 4096") == [131072, 1048576, 4096]
    with pytest.raises(Exception, match="expected positive sizes"):
        overhead._sizes("12q")
