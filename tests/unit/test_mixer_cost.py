"""The hybrid mixers' form choice (issue 55): :mod:`striped_sp.plan.mixer_cost` picks the head all-to-all,
state passing or the gather per kind, N and row length from fitted figures; the choice flips where the
model's predictions cross, past the heads it is state passing and never the gather, and the setup
line's summary names the form and the predictions.  Seen failing with the comparison inverted
(``max`` for ``min`` in :func:`~striped_sp.plan.mixer_cost.choose`)."""

import json

import pytest

from striped_sp.plan import mixer_cost
from striped_sp.plan.mixer_cost import choose, predict_ms, switches

# split: S/N + 1e-4 S^2/N; state: 2 S/N: equal at S = 10000 whatever N; the gather 10 S
TOY = {"toy": {"split": (1.0, 1e-4), "state": (2.0, 0.0), "gathered": (10.0, 0.0)}}


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_choice_flips_where_the_predictions_cross(n):
    below, above = choose("toy", n, 9990, True, True, TOY), choose("toy", n, 10010, True, True, TOY)
    assert below[0] == "split" and above[0] == "state", (below, above)
    assert below[1]["split"] < below[1]["state"] < below[1]["gathered"]
    assert above[1]["state"] == pytest.approx(2 * 10010 / n)
    assert [(s, f) for s, f, _ in switches("toy", n, True, True, fitted=TOY)] == [(1024, "split"), (16384, "state")]


def test_past_the_heads_state_passing_never_the_gather():
    cheap_gather = {"toy": {"split": (5.0, 0.0), "state": (5.0, 0.0), "gathered": (0.1, 0.0)}}
    assert choose("toy", 8, 4096, True, True, cheap_gather)[0] == "gathered"  # it competes where the split could run
    form, predicted = choose("toy", 8, 4096, False, True, cheap_gather)
    assert form == "state" and set(predicted) == set(), predicted  # the only candidate
    assert choose("toy", 8, 4096, False, False, cheap_gather)[0] == "gathered"  # nothing else can run


def test_a_kind_without_figures_keeps_the_rule():
    assert choose("unmeasured", 4, 16384, True, True) == ("split", {})
    assert choose("unmeasured", 4, 16384, False, True) == ("state", {})
    assert switches("unmeasured", 4, True, True) == [(1024, "split", {})]


def test_the_shipped_figures_pick_within_5_percent_of_the_measured_fastest():
    """The rows they were fitted on (docs/results.md, state passing measured): the model's choice costs
    at most 5 % more than the measured fastest form (the close calls are at 4k tokens)."""
    rows = {("gated delta net", 2, 4096): (877, 639), ("gated delta net", 2, 16384): (4706, 6586),
            ("gated delta net", 4, 4096): (342, 352), ("gated delta net", 4, 16384): (1723, 3099),
            ("Mamba2", 2, 4096): (729, 665), ("Mamba2", 2, 16384): (3457, 3151),
            ("Mamba2", 4, 4096): (398, 353), ("Mamba2", 4, 16384): (1293, 1557)}
    for (kind, n, seq), (state, split) in rows.items():
        form, predicted = choose(kind, n, seq, True, True)
        measured = {"state": state, "split": split}
        assert measured[form] <= 1.05 * min(measured.values()), (kind, n, seq, predicted)
        for f in ("state", "split"):
            assert predict_ms(kind, f, n, seq) == pytest.approx(measured[f], rel=0.2), (kind, n, seq, f)


def test_the_refit_reproduces_its_figures(tmp_path, capsys):
    """``state_split --fit`` on records made from the model itself returns the model's figures, and
    tests them on the rows of other N and lengths (error 0, the choice the fastest)."""
    from striped_sp.bench import state_split
    from striped_sp.bench.mixer_fit import fit, fitted_source

    records = [{"kind": "gated_delta", "N": n, "S": s, **{f"{f}_cpu_ms": predict_ms("gated delta net", f, n, s)
                                                          for f in mixer_cost.FORMS}}
               for n in (2, 4, 8) for s in (4096, 8192, 16384)]
    got = fit(records, {4096, 16384}, {2, 4})["gated delta net"]
    for f in mixer_cost.FORMS:
        assert got[f] == pytest.approx(mixer_cost.FITTED["gated delta net"][f], rel=1e-6)
    assert '"gated delta net": {"split": (' in fitted_source({"gated delta net": got})
    (tmp_path / "r.json").write_text(json.dumps(records))
    assert state_split.main(["--fit", str(tmp_path / "r.json"), "--fit-world-sizes", "2,4"]) == 0
    out = capsys.readouterr().out
    assert "fitted: S in [4096, 16384], N in [2, 4]" in out and "|error|: median 0.00, max 0.00" in out, out
    assert "costs at most 1.00x the measured fastest" in out, out


def _tiny(model_type, **overrides):
    pytest.importorskip("transformers")
    from support.token_mixing import HYBRID_SHAPES, tiny_causal_lm

    return tiny_causal_lm(model_type, **{**HYBRID_SHAPES[model_type], **overrides})[0]


def test_the_setup_line_says_which_form_and_why(monkeypatch):
    from striped_sp.deepspeed.hybrid import MODE_ENV, mixer_summary

    monkeypatch.delenv(MODE_ENV, raising=False)
    model = _tiny("qwen3_next")  # 2 gated delta net layers, heads divide by 2
    rule = mixer_summary(model, 2)
    assert rule.startswith("mixers: ") and " by row length (gated delta net: split below " in rule, rule
    assert "state passing from " in rule and "predicted fwd+bwd per layer at " in rule, rule
    long = mixer_summary(model, 2, 1 << 17)
    assert " state passing (gated delta net: state passing " in long and " ms at 131072 tokens" in long, long
    assert " split (gated delta net: split " in mixer_summary(model, 2, 1024), mixer_summary(model, 2, 1024)
    monkeypatch.setenv(MODE_ENV, "split")
    assert mixer_summary(model, 2, 1 << 17).endswith(" split (gated delta net)")


def test_the_choice_is_made_once_per_row_length(monkeypatch):
    """A layer's later calls look the choice up: one decision per (N, mode, row length)."""
    import striped_sp.deepspeed.hybrid as hybrid

    module = next(m for m in _tiny("qwen3_next").modules() if type(m).__name__.endswith("GatedDeltaNet"))
    calls = []
    real = hybrid.choose_form
    monkeypatch.setattr(hybrid, "choose_form", lambda *a: calls.append(a[1:]) or real(*a))
    for seq in (1024, 1024, 1 << 17, 1024, 1 << 17):
        hybrid._split_for(module, 2, seq, (), {})
    assert calls == [(2, 1024), (2, 1 << 17)], calls
    assert type(hybrid._split_for(module, 2, 1 << 17, (), {})).__name__ == "GatedDeltaNetState"
    assert type(hybrid._split_for(module, 2, 1024, (), {})).__name__ == "GatedDeltaNetSplit"
