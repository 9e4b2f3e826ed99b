"""The DeepSpeed setup line says when the model's attention has sinks (gpt-oss) or logit
soft-capping (Gemma 2), and with soft-capping on names a kernel that caps (issue 47)."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")

import striped_sp.deepspeed as ssd  # noqa: E402


def _line(model, world_of_one):
    from striped_sp.deepspeed.report import setup_line

    settings = ssd.parse_config({"sequence_parallel_size": 2, "context_parallel": {}})
    return setup_line(model, settings, SimpleNamespace(group=world_of_one, dp_size=1), {})


def test_the_setup_line_says_softcap_and_the_capping_kernel(world_of_one):
    from support.token_mixing import tiny_causal_lm

    model, why = tiny_causal_lm("gemma2", num_hidden_layers=2, attn_logit_softcapping=50.0, head_dim=16)
    assert model is not None, why
    line = _line(model, world_of_one)
    assert line.endswith("; softcap 50.0") and "sinks on" not in line, line
    assert "kernel math on cpu" in line and "torch: it has no logit soft-capping" in line, line


def test_the_setup_line_says_sinks_on(world_of_one):
    from support.token_mixing import tiny_causal_lm

    model, why = tiny_causal_lm("gpt_oss", num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                                head_dim=16, layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    assert model is not None, why
    line = _line(model, world_of_one)
    assert line.endswith("; sinks on") and "softcap" not in line, line


def test_the_setup_line_of_a_plain_model_says_neither(world_of_one):
    from support.token_mixing import tiny_causal_lm

    model, why = tiny_causal_lm("llama", num_hidden_layers=1)
    assert model is not None, why
    line = _line(model, world_of_one)
    assert "sinks" not in line and "softcap" not in line, line
