"""The GPU cost models (plan/cost.py): predictions from published kernel figures, labelled so until
a calibration on the device is adopted; held against ring-flash-attention's published 8xH800
figures through ``bench sim --predict`` (nothing computed on tensors: every rank's plan priced)."""

from __future__ import annotations

import dataclasses

import pytest

from striped_sp.bench.predict import (RING_FLASH_ATTN_H800, fwd_bwd_speedup, kernel_class_of, predict_layouts,
                                      ring_flash_attn_setup)
from striped_sp.kernels import KERNELS
from striped_sp.plan import cost
from striped_sp.plan.cost import COST_MODELS, GPU_ARCHS, fitted_model, gpu_model, model_for, use_model
from striped_sp.plan.layouts import get_layout
from striped_sp.plan.ring_plan import build_host_plan, compile_plan

CLASSES = ("fa4", "fa3", "cudnn", "fa2", "torch_flash", "efficient")


@pytest.fixture(autouse=True)
def _table_models():
    use_model(None)
    try:
        yield
    finally:
        use_model(None)


@pytest.mark.parametrize("arch", sorted(GPU_ARCHS))
def test_every_gpu_model_is_a_labelled_prediction(arch):
    for cls in CLASSES:
        m = gpu_model(cls, arch)
        assert not m.measured and m.label == f"{cls}@{arch} (a prediction)" and m.arch == arch
        assert m.ns_per_entry > 0 and m.backward_factor > 1 and m.merge_ns_per_row > 0 and m.overlaps_transfer
    # the faster classes are faster on the architectures they run on
    h100 = {c: gpu_model(c, "H100").ns_per_entry for c in CLASSES}
    assert h100["fa4"] == h100["fa3"] < h100["cudnn"] < h100["fa2"] == h100["torch_flash"] < h100["efficient"]
    with pytest.raises(ValueError, match="unknown GPU architecture 'V100'"):
        gpu_model("fa2", "V100")
    with pytest.raises(ValueError, match="no GPU model for kernel class 'math'"):
        gpu_model("math", "H100")


def test_model_for_prices_the_kernel_class_that_runs_and_a_calibration_when_adopted():
    arch = cost.gpu_arch()
    assert model_for("fa4", "cuda") is COST_MODELS[f"fa4@{arch}"]
    assert model_for("flash_attn", "cuda") is COST_MODELS[f"fa2@{arch}"]
    dense = build_host_plan(get_layout("striped"), None, True, 2, 0, 1024)

    def compiled(name):
        return compile_plan(dense, kernel=KERNELS[name], scale=0.1, device="meta", heads=8, head_dim=64)

    assert compiled("fa4").cost_model == f"fa4@{arch} (a prediction)"
    assert compiled("flash_attn").cost_model == f"fa2@{arch} (a prediction)"
    measured = fitted_model("fa4", "meta", 2e-4, 100.0, 50.0)  # as calibrate_cost_model builds it
    assert measured.label == "fa4@meta" and measured.measured
    assert measured.merge_ns_per_row == gpu_model("fa4", arch).merge_ns_per_row  # ring terms: the GPU model's
    use_model(measured)
    assert model_for("fa4", "meta") is measured and compiled("fa4").cost_model == "fa4@meta"
    assert model_for("auto", "meta") is measured  # auto's placement on that device type too
    assert compiled("flash_attn").cost_model == f"fa2@{arch} (a prediction)"  # not another kernel's
    assert model_for("fa4", "cuda") is COST_MODELS[f"fa4@{arch}"]  # nor another device type's


def test_the_fa2_model_reproduces_ring_flash_attention_on_8_h800_within_5_points():
    """8 GPUs, 8192 tokens each, 32 q / 8 kv heads x 128, bf16, fwd+bwd, FA2: % of ideal against
    N x one GPU's flash_attn on its own 8192 tokens, as ring-flash-attention's README measures it."""
    got = ring_flash_attn_setup("H800", "flash_attn")
    assert set(got) == set(RING_FLASH_ATTN_H800)
    for layout, published in RING_FLASH_ATTN_H800.items():
        assert abs(got[layout] - published) <= 5.0, (layout, got[layout], published)


def test_fa3_and_fa4_over_fa2_within_flashattention3s_published_range_on_h100():
    for cls in ("fa3", "fa4"):
        assert 1.5 <= fwd_bwd_speedup("H100", cls) <= 2.0, cls
    assert fwd_bwd_speedup("H100", "cudnn") > 1.3


def test_predict_mode_records():
    recs = predict_layouts("H100", "auto", ("zigzag", "contiguous"), 4, 1024)
    assert {r["kernel_class"] for r in recs} == {"fa4"} and kernel_class_of("auto", "A100", False) == "fa2"
    assert kernel_class_of("torch_cudnn", "H100", True) == "efficient"
    by = {(r["layout"], r["pass"]): r for r in recs}
    assert by[("zigzag", "fwd+bwd")]["critical_path_ms"] < by[("contiguous", "fwd+bwd")]["critical_path_ms"]
    assert all(0 < r["of_ideal"] < 1.05 and 0 < r["efficiency"] < 1.05 for r in recs)
    with pytest.raises(ValueError, match="each a multiple of N"):
        predict_layouts("H100", "fa2", ("zigzag",), 4, 1024, bounds=[0, 1001, 4096])
    slow = dataclasses.replace(gpu_model("fa2", "H800"), merge_ns_per_row=0.0)
    assert ring_flash_attn_setup(model=slow)["zigzag"] > ring_flash_attn_setup()["zigzag"]


def test_predict_mode_prices_the_row_that_was_asked_for():
    """``--docs`` / ``--window``: each layout's critical path is the model's price of the very plans
    ``bench sim``'s masked path runs for that row (same calls, steps and shared rows per rank), the
    striped default's search choosing as on the GPU; the figures change with the documents and the window."""
    import torch

    from striped_sp.bench import predict
    from striped_sp.bench.docs import workload
    from striped_sp.bench.sim import SimConfig, ring_plans, sim_kernel
    from striped_sp.bench.sim_masked import masked_request

    n, tpr, mix, layouts = 4, 1024, "lognormal:median=300,sigma=1.2", ("striped", "zigzag", "contiguous")
    shape = predict.PredictShape(heads=8, kv_heads=2, head_dim=64)
    cfg = SimConfig(layouts=layouts, heads=8, kv_heads=2, head_dim=64, dtype=torch.float32, device=torch.device("cpu"))
    kernel = sim_kernel(cfg)
    model = gpu_model("fa4", "H100")
    crit = {}
    for docs, window in ((None, 0), (mix, 0), (None, 256), (mix, 256)):
        recs = predict_layouts("H100", "auto", layouts, n, tpr, shape, docs=docs, window=window)
        for layout in layouts:
            rec = next(r for r in recs if r["layout"] == layout and r["pass"] == "fwd+bwd")
            crit[(docs, window, layout)] = rec["critical_path_ms"]
            if docs is None and not window:
                continue
            with predict._searching_on("H100"):  # the sim's own plans for the row, chosen as on the GPU
                work = workload(layout, n, tpr, docs, window)
                plans = ring_plans(cfg, masked_request(layout, work, docs, window), n, work.local_len, kernel)
            assert rec["critical_path_ms"] == pytest.approx(predict._ring_seconds(model, plans, shape)["fwd+bwd"] * 1e3,
                                                            rel=1e-12), (docs, window, layout)
            assert rec["padding_tokens"] == work.padding_tokens and rec["documents"] == len(work.mask.bounds) - 1
            if layout == "striped" and docs:
                assert "fa4@H100" in rec["plan"]  # the search priced candidates by the GPU's model
    for layout in layouts:
        figures = [crit[(d, w, layout)] for d in (None, mix) for w in (0, 256)]
        assert len(set(figures)) == 4, (layout, figures)


def test_predict_mode_on_the_command_line_takes_docs_and_window_and_refuses_what_it_cannot_price(capsys):
    from striped_sp.cli import main

    def table(*extra):
        assert main(["bench", "sim", "--predict", "H100", "--world-sizes", "4", "--tokens-per-rank", "1024",
                     "--layouts", "striped,zigzag", *extra]) == 0
        out = capsys.readouterr().out
        return [line for line in out.splitlines() if line.startswith(("striped ", "zigzag "))], out

    dense, _ = table()
    packed, out = table("--docs", "lognormal:median=300,sigma=1.2")
    assert "documents lognormal:median=300,sigma=1.2" in out and "padding" in out
    windowed, out = table("--window", "256")
    assert "window 256" in out
    assert dense != packed and dense != windowed and packed != windowed
    for extra, flag in ((["--global-every", "2", "--window", "64"], "--global-every"),
                        (["--link-gbps", "100"], "--link-gbps"), (["--plot", "x.png"], "--plot")):
        with pytest.raises(SystemExit, match=flag):
            main(["bench", "sim", "--predict", "H100", *extra])
