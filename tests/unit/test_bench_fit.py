"""``striped-sp bench fit``'s arithmetic (striped_sp/bench/fit.py) on synthetic data: the two scales
recovered from samples built with known ones, the least-squares solution on noisy samples checked
against torch's solver, the relative errors, the refusal of features that cannot separate the
scales, and a record's features priced as the search prices its plan."""

from __future__ import annotations

import random

import pytest
import torch

from seeds import seed_for
from striped_sp.bench.fit import Sample, errors, fit_scales, predict, samples_from_records
from striped_sp.plan.cost import model_named
from striped_sp.plan.search import predict_ring, predict_zigzag

pytestmark = pytest.mark.unit

SEED = seed_for(__name__)


def _sample(xk, xs, y):
    return Sample("mix", "striped", 4, 2048, float(xk), float(xs), float(y))


def test_exact_scales_are_recovered():
    rng = random.Random(SEED)
    a, b = 0.43, 0.517
    samples = [_sample(xk, xs, a * xk + b * xs) for xk, xs in
               ((rng.uniform(50, 900), rng.choice([4, 8, 16, 32])) for _ in range(7))]
    got_a, got_b = fit_scales(samples)
    assert got_a == pytest.approx(a, rel=1e-12) and got_b == pytest.approx(b, rel=1e-12), SEED
    assert max(abs(e) for e in errors(samples, got_a, got_b)) < 1e-12


def test_noisy_fit_is_the_least_squares_solution():
    rng = random.Random(SEED + 1)
    samples = [_sample(xk, xs, (0.7 * xk + 2.0 * xs) * rng.uniform(0.8, 1.2)) for xk, xs in
               ((rng.uniform(10, 500), rng.randint(1, 40)) for _ in range(11))]
    x = torch.tensor([[s.x_kernel, s.x_steps] for s in samples], dtype=torch.float64)
    y = torch.tensor([[s.measured_ms] for s in samples], dtype=torch.float64)
    want = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    assert list(fit_scales(samples)) == pytest.approx(want, rel=1e-9), SEED


def test_errors_are_predicted_over_measured_minus_one():
    s = _sample(100.0, 10.0, 80.0)
    assert predict(s, 0.5, 2.0) == 70.0
    assert errors([s], 0.5, 2.0) == [pytest.approx(70.0 / 80.0 - 1)]


@pytest.mark.parametrize("samples", [[_sample(1, 1, 1)], [_sample(10, 2, 5), _sample(20, 4, 9)]])
def test_refuses_what_cannot_separate_two_scales(samples):
    with pytest.raises(ValueError, match="fit_scales"):
        fit_scales(samples)


def test_a_records_features_are_the_searchs_prediction():
    """A striped record is priced with the plan the row ran (its stripe size and whole_max), zigzag
    with its padded documents; the kernel feature is heads x (1 + backward factor) x the per-step
    forward compute, the step feature heads x steps; a layout without a model (contiguous) is left out."""
    from striped_sp.bench.docs import workload

    model, mix, n, tpr, heads = model_named("cpu"), "lognormal:median=128,sigma=1.2", 4, 256, 3
    bounds = tuple(workload("striped", n, tpr, mix, None).mask.bounds)
    recs = [{"pass": "fwd+bwd", "world_size": n, "tokens_per_rank": tpr, "layout": "striped:stripe=doc",
             "plan_stripe_size": "doc", "plan_whole_max": 128, "critical_path_ms": 9.0},
            {"pass": "forward", "world_size": n, "tokens_per_rank": tpr, "layout": "zigzag", "critical_path_ms": 1.0},
            {"pass": "fwd+bwd", "world_size": n, "tokens_per_rank": tpr, "layout": "zigzag", "critical_path_ms": 7.0},
            {"pass": "fwd+bwd", "world_size": n, "tokens_per_rank": tpr, "layout": "contiguous",
             "critical_path_ms": 8.0}]
    got = samples_from_records(recs, mix, heads, model)
    assert [(s.layout, s.measured_ms) for s in got] == [("striped:stripe=doc", 9.0), ("zigzag", 7.0)]
    for s, p in zip(got, (predict_ring(bounds, n, "doc", 128, model), predict_zigzag(bounds, n, model))):
        assert s.x_kernel == pytest.approx(heads * (1 + model.backward_factor) * sum(p.compute_ms))
        assert s.x_steps == heads * p.steps
