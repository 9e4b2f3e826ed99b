"""It says it is on: under ``install()`` the first model built logs one line on global rank 0
(layout, CP groups, kernel and why, stripes, cost model), and Megatron's argument dump shows what
``--striped-stripe-size auto`` stands for (``striped_layout``, ``striped_stripe_policy``)."""

import argparse
import logging
import types

import pytest

pytest.importorskip("megatron.core")

import striped_sp.megatron as sm  # noqa: E402
from striped_sp.plan import cost  # noqa: E402
from striped_sp.setup_report import stripe_policy  # noqa: E402


@pytest.fixture
def megatron_world(world_of_one):
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    try:
        yield world_of_one
    finally:
        sm.uninstall()
        parallel_state.destroy_model_parallel()


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "striped_sp.megatron"]


def test_the_first_model_built_says_how_it_runs(megatron_world, caplog):
    from striped_sp.megatron.toy import tiny_gpt

    caplog.set_level(logging.INFO, logger="striped_sp.megatron")
    sm.install("striped")
    tiny_gpt(megatron_world, "striped")
    tiny_gpt(megatron_world, "striped")  # once per install, not per model
    (line,) = _lines(caplog)
    table = cost.model_for_kernel("torch", "cpu").label
    for part in ("striped_sp on (Megatron, --context-parallel-algo striped): layout striped",
                 "CP size 1 (ranks [0] of 1, 1 CP groups; --cp-comm-type p2p)",
                 "kernel torch on cpu (backend auto: the fastest class that runs",
                 stripe_policy("striped"),
                 f"cost model: the table's {table!r}, not calibrated here (--striped-calibrate measures it)"):
        assert part in line, (part, line)
    sm.install("striped:stripe=auto")  # another algo: said again
    tiny_gpt(megatron_world, "striped:stripe=auto")
    assert "stripe size auto: per packed batch" in _lines(caplog)[-1]


def test_a_calibration_is_reported_with_its_numbers(megatron_world, caplog, monkeypatch):
    from striped_sp.megatron.toy import tiny_gpt

    measured = cost.fitted_model("torch", "cpu", ns_per_entry=1.25, causal_waste=0.5, call_ns=40e3)
    monkeypatch.setattr(cost, "_ADOPTED", [measured])
    caplog.set_level(logging.INFO, logger="striped_sp.megatron")
    sm.install("zigzag")
    tiny_gpt(megatron_world, "zigzag")
    (line,) = _lines(caplog)
    assert "zigzag chunks" in line and "calibrated on this device: 1.25 ns per score entry, 40 us per call" in line


def _args(**kw):
    base = dict(context_parallel_algo="striped", striped_stripe_size=1, striped_doc_placement="split",
                context_parallel_size=2, seq_length=8192, sft=False, window_size=None, num_layers=4)
    return argparse.Namespace(**{**base, **kw})


@pytest.mark.parametrize("kw, layout, words", [
    (dict(striped_stripe_size="auto", sft=True), "striped:stripe=auto", "per packed batch"),
    # under a window: the placement the cost model picks for 4 window layers (plan/window_choice.py)
    (dict(striped_stripe_size="auto", window_size=(1024, 0)), "striped:stripe=4096", "stripes of 4096 tokens"),
    (dict(striped_stripe_size="auto"), "striped", stripe_policy("striped")),
    (dict(striped_stripe_size=1), "striped", stripe_policy("striped")),
    (dict(striped_stripe_size=4), "striped:stripe=4", "stripes of 4 tokens"),
    (dict(context_parallel_algo="native"), None, None),
])
def test_the_argument_dump_shows_what_auto_stands_for(kw, layout, words):
    from striped_sp.megatron.arguments import note_layout

    args = _args(**kw)
    note_layout(args)
    if args.window_size is not None:  # the row above names the cost model's choice: it is still its choice
        from striped_sp.plan.layouts import Striped
        from striped_sp.plan.window_choice import window_choice

        assert window_choice(8192, 2, 1024, 4, 0, striped=Striped)[0] == 4096
    assert getattr(args, "striped_layout", None) == layout
    if words:
        assert words in args.striped_stripe_policy


def test_the_no_patch_route_notes_the_layout_before_megatrons_dump():
    from striped_sp.megatron import pretrain_gpt as entry

    dumped = {}

    def validate_args(args, defaults={}):  # Megatron's: prints the arguments at its end
        dumped.update(vars(args))

    fake = types.SimpleNamespace(parse_args=lambda *a, **k: None, validate_args=validate_args)
    entry.hook_initialize(fake)
    try:
        fake.validate_args(_args(striped_stripe_size="auto", sft=True, calculate_per_token_loss=True), {})
    finally:
        sm.uninstall()
    assert dumped["striped_layout"] == "striped:stripe=auto"
