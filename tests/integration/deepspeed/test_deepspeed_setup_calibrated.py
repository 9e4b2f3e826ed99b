"""The DeepSpeed setup line reports what ``"calibrate": true`` measured (issue 36: nothing said it):
with a calibration adopted in the process (what :func:`striped_sp.deepspeed.initialize` does before
it logs the line), the line gives the measured numbers, not the table's model."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import striped_sp.deepspeed as ssd  # noqa: E402
from striped_sp.plan import cost  # noqa: E402


def test_the_setup_line_gives_the_calibrated_numbers(world_of_one, monkeypatch):
    from types import SimpleNamespace

    from transformers import LlamaConfig, LlamaForCausalLM

    from striped_sp.deepspeed.report import setup_line

    model = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    settings = ssd.parse_config({"sequence_parallel_size": 2, "context_parallel": {"calibrate": True}})
    groups = SimpleNamespace(group=world_of_one, dp_size=1)
    table = setup_line(model, settings, groups, {})
    assert "not calibrated here" in table, table
    measured = cost.fitted_model("torch", "cpu", ns_per_entry=1.25, causal_waste=0.5, call_ns=40e3)
    monkeypatch.setattr(cost, "_ADOPTED", [measured])
    line = setup_line(model, settings, groups, {})
    assert "cost model calibrated on this device: 1.25 ns per score entry, 40 us per call, causal waste 0.50" in line
