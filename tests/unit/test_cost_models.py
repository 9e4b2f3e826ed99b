"""plan/cost.py: one model per kernel and device type, a calibrated model adopted for the kernel it
timed (compiled plans, the ``auto`` search and the plan cache then use it), labelled predictions."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from striped_sp.engine.plans import PLANS, plan_for
from striped_sp.kernels import KERNELS
from striped_sp.plan import cost, search
from striped_sp.plan.cost import COST_MODELS, default_model, fitted_model, model_for, model_for_kernel, use_model
from striped_sp.plan.layouts import get_layout
from striped_sp.plan.masks import make_mask
from striped_sp.plan.ring_plan import _predicted_ms, build_host_plan, compile_plan

LAYOUT = get_layout("striped:stripe=1")  # stripes of 1 pinned: the bare default searches packed rows
#: short documents (squares of 20-120 rows per rank: size classes) and one of 1200 tokens (600 rows:
#: halved at 8 heads of 64 by the CPU op's table model)
BOUNDS = (0, 40, 100, 180, 300, 1500, 1600, 1664, 1800, 2048)
#: 16 documents of 512 tokens at N=2: the CPU's slow link keeps them all whole (one step), a fast
#: link splits them (docs/tuning.md, "Choosing a plan")
EVEN = tuple(range(0, 8193, 512))
#: a model that prices one more host call or batch beyond any compute: no halving, fewest classes
SLOW_HOST = dict(host_ns_per_call=1e12, host_ns_per_batch=1e12)


@pytest.fixture(autouse=True)
def _table_models():
    use_model(None)
    try:
        yield
    finally:
        use_model(None)
        search._placed_runs.cache_clear()
        PLANS.clear()


def _host():
    return build_host_plan(LAYOUT, make_mask(2048, 2, LAYOUT, list(BOUNDS)), True, 2, 0, 1024)


def _compiled(host, kernel="torch", device="cpu"):
    return compile_plan(host, kernel=KERNELS[kernel], scale=0.1, device=device, heads=8, head_dim=64)


def _shape(plan):
    """What the model decides in a compiled plan: kernel launches and the causal size classes."""
    return (sum(plan.launches(t) for t in range(plan.steps)),
            {b.cq for step in plan.programs for prog in step for b in prog.batches if b.causal})


def test_every_kernel_has_the_model_of_its_own_kind():
    assert model_for_kernel("torch", "cpu") is COST_MODELS["cpu"] and COST_MODELS["cpu"].measured
    math = model_for_kernel("math", "cpu")
    assert math is COST_MODELS["math_cpu"] and math.measured and math.label == "math_cpu"
    # the reference masks after computing the square: a causal call costs a full one, the CPU op less
    assert math.call(256, 256, True) == math.call(256, 256, False)
    assert COST_MODELS["cpu"].call(1024, 1024, True) < COST_MODELS["cpu"].call(1024, 1024, False)
    for name in KERNELS:
        for device_type in ("cuda", "meta"):  # meta: dry runs of the CUDA path
            model = model_for_kernel(name, device_type)  # the GPU model of the class that runs it: predicted
            assert model.label.endswith(f"@{cost.gpu_arch()} (a prediction)") and not model.measured, name
    assert model_for_kernel("fa4", "meta") is COST_MODELS[f"fa4@{cost.gpu_arch()}"]
    unknown = model_for_kernel("someone_elses", "cpu")
    assert unknown.label == "cpu (a prediction)" and unknown.ns_per_entry == COST_MODELS["cpu"].ns_per_entry
    assert default_model() is model_for_kernel("auto", "cuda" if torch.cuda.is_available() else "cpu")


def test_equal_models_are_equal_in_every_field():
    """A model is part of the search cache's key: two models differing in a fitted or a ring number
    are different keys."""
    base = COST_MODELS["cpu"]
    for field in ("ns_per_entry", "causal_waste", "call_ns", "transfer_ns_per_row", "host_ns_per_batch"):
        other = dataclasses.replace(base, **{field: getattr(base, field) * 2})
        assert other != base and len({base, other}) == 2, field
    assert dataclasses.replace(base) == base and hash(dataclasses.replace(base)) == hash(base)


def test_an_adopted_calibration_prices_the_plans_of_its_kernel():
    host = _host()
    table = _compiled(host)
    assert table.cost_model == "cpu" and _shape(table)[0] > 4 and len(_shape(table)[1]) > 1
    measured = dataclasses.replace(fitted_model("torch", "cpu", 7.8, 256.0, 20_000.0), **SLOW_HOST)
    use_model(measured)
    plan = _compiled(host)
    assert plan.cost_model == "torch@cpu"  # measured: no "(a prediction)"
    assert plan.predicted_ms == _predicted_ms(host, measured) != table.predicted_ms
    launches, classes = _shape(plan)
    assert launches < _shape(table)[0] and len(classes) == 1, (_shape(plan), _shape(table))
    # not the model of another kernel, nor of another device type
    assert _compiled(host, "math").cost_model == "math_cpu"
    dense = build_host_plan(LAYOUT, None, True, 2, 0, 1024)
    assert _compiled(dense, device="meta").cost_model == f"torch_flash@{cost.gpu_arch()} (a prediction)"


@pytest.mark.parametrize("kernel, device_type", [("math", "cpu"), ("torch", "cuda"), ("torch", "meta")])
def test_a_calibration_of_another_kernel_or_device_leaves_the_table(kernel, device_type):
    host = _host()
    use_model(dataclasses.replace(fitted_model(kernel, device_type, 7.8, 256.0, 20_000.0), **SLOW_HOST))
    assert model_for("torch", "cpu") is COST_MODELS["cpu"]
    plan = _compiled(host)
    assert plan.cost_model == "cpu" and plan.predicted_ms == _predicted_ms(host, COST_MODELS["cpu"])
    dense = build_host_plan(LAYOUT, None, True, 2, 0, 1024)
    if device_type != "meta":
        assert _compiled(dense, device="meta").cost_model == f"torch_flash@{cost.gpu_arch()} (a prediction)"
    else:
        assert _compiled(dense, device="meta").cost_model == "torch@meta"


def test_the_default_model_is_the_adopted_one_of_its_device_type():
    here = "cuda" if torch.cuda.is_available() else "cpu"
    mine = fitted_model("torch", here, 1.0, 64.0, 1_000.0)
    use_model(mine)
    assert default_model() is mine and model_for("auto", here) is mine
    use_model(fitted_model("torch", "meta", 1.0, 64.0, 1_000.0))
    assert default_model() is model_for_kernel("auto", here)
    with pytest.raises(ValueError, match="names no kernel and device type"):
        use_model(COST_MODELS["flash_attn"])


def test_a_cached_choice_is_never_one_made_with_another_model():
    slow_link = COST_MODELS["cpu"]
    fast_link = dataclasses.replace(slow_link, transfer_ns_per_row=1.0)  # same name: only the link differs
    assert search.search(EVEN, 2, slow_link)[0].steps == 1  # all whole: nothing sent
    assert search.search(EVEN, 2, fast_link)[0].steps == 2
    assert search.search(EVEN, 2, slow_link)[0].steps == 1
    # the placement of an ``auto`` layout follows the adopted model (resolved before the cache)
    here = "cuda" if torch.cuda.is_available() else "cpu"
    adopt = dict(kernel="torch", device_type=here)
    use_model(dataclasses.replace(slow_link, name="slow", **adopt))
    whole = search.placed_runs(EVEN, 2, "auto", "auto")
    use_model(dataclasses.replace(fast_link, name="slow", **adopt))
    split = search.placed_runs(EVEN, 2, "auto", "auto")
    assert [t.tolist() for t in whole] != [t.tolist() for t in split]


def test_the_plan_cache_compiles_anew_for_a_model_adopted_later():
    spec = make_mask(2048, 2, LAYOUT, list(BOUNDS))

    def plan():
        return plan_for(LAYOUT, spec, True, 2, 0, 1024, kernel=KERNELS["torch"], scale=0.1, heads=8, head_dim=64)

    assert plan().cost_model == "cpu" and plan() is plan()
    use_model(dataclasses.replace(fitted_model("torch", "cpu", 7.8, 256.0, 20_000.0), **SLOW_HOST))
    assert plan().cost_model == "torch@cpu" and len(_shape(plan())[1]) == 1


def test_calibrating_a_kernel_adopts_a_model_for_it():
    model = cost.calibrate(KERNELS["math"], "cpu", sizes=(64, 128), reps=1)
    assert (model.name, model.kernel, model.device_type, model.measured) == ("math@cpu", "math", "cpu", True)
    assert model.backward_factor == COST_MODELS["math_cpu"].backward_factor  # ring terms: the kernel's table model
    use_model(model)
    assert model_for("math", "cpu") is model and model_for("torch", "cpu") is COST_MODELS["cpu"]
    assert _compiled(_host(), "math").cost_model == "math@cpu"
