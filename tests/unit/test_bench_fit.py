"""``striped-sp bench fit``'s arithmetic (striped_sp/bench/fit.py) on synthetic data: the two scales
recovered from samples built with known ones, the least-squares solution on noisy samples checked
against torch's solver, the relative errors, the refusal of features that cannot separate the
scales, and a record's features priced as the search prices its plan; then the measuring path and the
command line (``striped-sp bench fit``) on tiny rows: the median over rounds kept (a clock with known
times), and the table model's prediction against one computed here from the search's predictions."""

from __future__ import annotations

import json
import random
import statistics

import pytest
import torch

from seeds import seed_for
from striped_sp.bench.fit import Sample, errors, fit_scales, predict, samples_from_records
from striped_sp.plan.cost import default_model, model_named
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


# ---------------------------------------------------------------- the measuring path and the command line

_LAYOUTS = {"striped:stripe=1": (1, 0), "striped:stripe=doc": ("doc", 0), "zigzag": None}  # -> (stripe, whole_max)
_FIT_MIX, _TEST_MIX = "fixed:16", "lognormal:median=16,sigma=1"
_N, _TPR, _HEADS = 2, 32, 2


def _run_fit(tmp_path, rounds, capsys):
    from striped_sp.cli import main

    path = tmp_path / "fit.json"
    rc = main(["bench", "fit", "--fit-mixes", _FIT_MIX, "--test-mixes", _TEST_MIX, "--layouts", ";".join(_LAYOUTS),
               "--world-sizes", str(_N), "--tokens-per-rank", str(_TPR), "--heads", str(_HEADS), "--head-dim", "8",
               "--reps", "1", "--rounds", str(rounds), "--json", str(path), "--no-progress"])
    assert rc == 0
    return json.loads(path.read_text()), capsys.readouterr().out


def _features(mix, layout):
    """``(x_kernel, x_steps)`` of one row from the search's predictions: heads x (1 + backward factor) x the
    per-step forward compute (ms), heads x ring steps."""
    from striped_sp.bench.docs import workload

    model = default_model()
    bounds = tuple(workload("striped", _N, _TPR, mix, None).mask.bounds)
    plan = _LAYOUTS[layout]
    pred = predict_zigzag(bounds, _N, model) if plan is None else predict_ring(bounds, _N, *plan, model)
    return _HEADS * (1 + model.backward_factor) * sum(pred.compute_ms), float(_HEADS * pred.steps)


def _check_rows(rows):
    """A row per (set, mix, layout); the table's model (kernel scale 1, the model's step cost, ns -> ms)
    and both errors as computed here."""
    assert sorted((r["set"], r["mix"], r["layout"]) for r in rows) == sorted(
        [("fit", _FIT_MIX, lay) for lay in _LAYOUTS] + [("test", _TEST_MIX, lay) for lay in _LAYOUTS])
    for r in rows:
        xk, xs = _features(r["mix"], r["layout"])
        assert r["measured_ms"] > 0 and (r["N"], r["tokens/rank"]) == (_N, _TPR)
        assert r["table_model_ms"] == pytest.approx(xk + xs * default_model().step_ns * 1e-6, rel=1e-9), r
        assert r["table_model_error"] == pytest.approx(r["table_model_ms"] / r["measured_ms"] - 1, rel=1e-9)
        assert r["error"] == pytest.approx(r["predicted_ms"] / r["measured_ms"] - 1, rel=1e-9)


def test_fit_command_measures_with_the_sim(tmp_path, capsys):
    """``bench fit`` end to end with the sim's own clock: the rows, and the table's step cost printed in
    microseconds per head."""
    rows, out = _run_fit(tmp_path, 1, capsys)
    _check_rows(rows)
    assert f"(the table's model: a = 1, b = {default_model().step_ns / 1e3:.1f} us)" in out


def test_fit_keeps_the_median_of_its_rounds(tmp_path, capsys, monkeypatch):
    """A clock that reports known critical paths, scaled per round by 5, 1 and 100: every sample's
    measured time is the median round's (5x), not the last (100x) nor the mean; the fitted predictions
    are the least squares of those medians (torch's solver on the features computed here)."""
    import striped_sp.bench.sim_masked as sim_masked

    base_s = {(_FIT_MIX, "striped:stripe=1"): 0.004, (_FIT_MIX, "striped:stripe=doc"): 0.002,
              (_FIT_MIX, "zigzag"): 0.003, (_TEST_MIX, "striped:stripe=1"): 0.005,
              (_TEST_MIX, "striped:stripe=doc"): 0.001, (_TEST_MIX, "zigzag"): 0.006}
    factors, calls = (5.0, 1.0, 100.0), []

    def clock(cfg, rings, bar):  # each round times the fit mix, then the test mix (one point each)
        mix, scale = (_FIT_MIX, _TEST_MIX)[len(calls) % 2], factors[len(calls) // 2]
        calls.append(sorted(rings))
        return {lay: {p: base_s[mix, lay] * scale for p in sim_masked.PASSES} for lay in rings}

    monkeypatch.setattr(sim_masked, "time_rings", clock)
    rows, _ = _run_fit(tmp_path, 3, capsys)
    assert calls == [sorted(_LAYOUTS)] * 6
    _check_rows(rows)
    for r in rows:
        assert r["measured_ms"] == pytest.approx(base_s[r["mix"], r["layout"]] * 5.0 * 1e3, rel=1e-12), r
    fit = [r for r in rows if r["set"] == "fit"]
    x = torch.tensor([_features(r["mix"], r["layout"]) for r in fit], dtype=torch.float64)
    y = torch.tensor([[r["measured_ms"]] for r in fit], dtype=torch.float64)
    a, b = torch.linalg.lstsq(x, y).solution.flatten().tolist()
    for r in rows:
        xk, xs = _features(r["mix"], r["layout"])
        assert r["predicted_ms"] == pytest.approx(a * xk + b * xs, rel=1e-9), r


def test_the_causal_term_is_recovered_and_refused_when_it_cannot_separate():
    from striped_sp.bench.fit import fit_terms, predict_terms

    rng = random.Random(SEED + 7)
    terms = (0.9, 1.35, 0.25)
    samples = []
    for _ in range(9):
        xk, xc, xs = rng.uniform(50, 900), rng.uniform(0, 40), rng.choice([4, 8, 16, 32])
        samples.append(Sample("mix", "striped", 4, 2048, xk, xs, terms[0] * (xk - xc) + terms[1] * xc + terms[2] * xs,
                              xc))
    assert fit_terms(samples) == pytest.approx(terms, rel=1e-9), SEED
    assert all(predict_terms(s, terms) == pytest.approx(s.measured_ms, rel=1e-12) for s in samples)
    with pytest.raises(ValueError, match="fit_terms"):
        fit_terms([_sample(10, 2, 5), _sample(20, 4, 9), _sample(30, 6, 14)])  # no causal part: rank 2


def test_a_causal_factor_prices_only_the_diagonal_masked_calls():
    import dataclasses

    model = model_named("cpu")
    slow = dataclasses.replace(model, causal_factor=1.5)
    assert slow.call(512, 256, False) == model.call(512, 256, False)
    assert slow.call(512, 512, True) - slow.call_ns == pytest.approx(1.5 * (model.call(512, 512, True) - model.call_ns))
