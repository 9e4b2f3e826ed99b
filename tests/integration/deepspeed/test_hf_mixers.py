"""Hybrid models on the Hugging Face path: nothing silently wrong.

A transformers model with a token mixer other than attention (gated delta net, Mamba / Mamba2,
short convolution, linear or chunked attention) is refused by every route that would run it under
context parallelism, naming the model class, the layer and the mixer, before any collective.  The
walk at the end judges the rule (:mod:`striped_sp.deepspeed.mixers`) by a probe that knows no rule
(:mod:`support.token_mixing`): every causal LM class of the installed transformers that mixes tokens
outside attention must be refused, and every one that does not must be let through.
"""

import os
import types

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

import striped_sp.deepspeed as ssd  # noqa: E402
from striped_sp.deepspeed.mixers import check_model_mixers, unhandled_mixers  # noqa: E402
from support.token_mixing import mixes_tokens_outside_attention, tiny_causal_lm  # noqa: E402

transformers.logging.set_verbosity_error()

#: model type -> the mixer class the refusal must name (one per family the issue names)
FAMILIES = {
    "qwen3_next": "Qwen3NextGatedDeltaNet",
    "jamba": "JambaMambaMixer",
    "falcon_h1": "FalconH1Mixer",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "lfm2": "Lfm2ShortConv",
}
#: configs shaped like the released models where the config's defaults have no such mixer (LFM2's
#: default puts attention in every layer; LFM2-350M alternates short convolutions and attention)
SHAPES = {"lfm2": {"num_hidden_layers": 4, "layer_types": ["conv", "full_attention", "conv", "full_attention"]}}
CONFIG = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2, "zero_optimization": {"stage": 0},
          "context_parallel": {"algo": "striped"}}


def _model(model_type):
    model, why = tiny_causal_lm(model_type, **SHAPES.get(model_type, {}))
    if model is None:
        pytest.skip(f"{model_type}: {why}")
    return model


def _refusal(model_type):
    return rf"{type(_model(model_type)).__name__} mixes tokens outside attention"


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_enabling_the_attention_refuses_a_hybrid_naming_class_layer_and_mixer(model_type):
    model = _model(model_type)
    before = model.config._attn_implementation
    with pytest.raises(ValueError) as err:
        ssd.enable_hf_attention(model, None, "striped")
    text = str(err.value)
    assert f"{type(model).__name__} mixes tokens outside attention" in text
    assert f"({FAMILIES[model_type]}:" in text and "layer " in text and "sequence_parallel_size=1" in text
    assert model.config._attn_implementation == before  # refused before anything was switched


def _no_collective(monkeypatch):
    import deepspeed

    def refuse(*args, **kwargs):
        raise AssertionError("a collective was reached before the model was refused")

    monkeypatch.setattr(deepspeed, "init_distributed", refuse)


@pytest.mark.parametrize("model_type", ["qwen3_next", "lfm2"])
def test_initialize_refuses_a_hybrid_before_any_collective(monkeypatch, model_type):
    _no_collective(monkeypatch)
    with pytest.raises(ValueError, match=_refusal(model_type)):
        ssd.initialize(model=_model(model_type), config=dict(CONFIG))
    with pytest.raises(AssertionError, match="collective"):  # without SP the model is DeepSpeed's
        ssd.initialize(model=_model(model_type), config={**CONFIG, "sequence_parallel_size": 1})


def test_the_trainer_and_accelerate_refuse_a_hybrid_when_built(monkeypatch, tmp_path):
    pytest.importorskip("accelerate")
    from striped_sp.deepspeed import trainer

    monkeypatch.setattr(trainer, "_world_size", lambda args: 2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), deepspeed={**CONFIG, "train_micro_batch_size_per_gpu": "auto"},
                                          use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=_refusal("jamba")):
        trainer.ContextParallelTrainer(model=_model("jamba"), args=args)
    accelerator = types.SimpleNamespace(num_processes=2, split_batches=False, parallelism_config=None)
    with pytest.raises(ValueError, match=_refusal("falcon_h1")):
        ssd.enable_accelerate(accelerator, config=dict(CONFIG), model=_model("falcon_h1"))


def _llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, **config))


def test_an_unknown_mixer_is_refused_by_what_it_contains_not_by_its_name():
    model = _llama()
    check_model_mixers(model)  # attention only: let through
    model.model.layers[1].token_shift = torch.nn.Conv1d(32, 32, kernel_size=2, groups=32)  # no known name
    with pytest.raises(ValueError, match=r"layer 1 model\.layers\.1\.token_shift \(Conv1d: a Conv1d of kernel 2 "):
        check_model_mixers(model)
    model = _llama()
    model.model.layers[2].mlp.A_log = torch.nn.Parameter(torch.zeros(4))
    assert [(m.layer, m.path, m.kind) for m in unhandled_mixers(model)] == [(2, "model.layers.2.mlp", "LlamaMLP")]


def test_layer_types_the_ring_does_not_run_are_refused_naming_the_layer():
    model = _llama()
    model.config.layer_types = ["full_attention", "sliding_attention", "chunked_attention"]
    with pytest.raises(ValueError, match=r"layer 2 config\.layer_types\[2\] \(chunked_attention: "):
        check_model_mixers(model)
    model.config.layer_types = ["full_attention", "sliding_attention", "attention"]
    check_model_mixers(model)


def _causal_lm_types():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def test_every_causal_lm_that_mixes_tokens_outside_attention_is_refused():
    """Exact or refused by name, over the whole installed transformers: the probe decides which
    classes mix tokens outside attention; the rule must refuse exactly those (attention-only
    classes run the ring, which the exactness tests cover)."""
    judged, mixing, silently_wrong, refused_needlessly = 0, [], [], []
    for model_type in _causal_lm_types():
        model, _ = tiny_causal_lm(model_type, **SHAPES.get(model_type, {}))
        if model is None:
            continue
        refused = bool(unhandled_mixers(model))
        mixes = mixes_tokens_outside_attention(model)
        if mixes is None:  # does not run, or never takes our attention (enable_hf_attention refuses it)
            continue
        judged += 1
        if mixes:
            mixing.append(model_type)
        if mixes and not refused:
            silently_wrong.append(model_type)
        if refused and not mixes:
            refused_needlessly.append(model_type)
    assert not silently_wrong, f"mix tokens outside attention and are not refused: {silently_wrong}"
    assert not refused_needlessly, f"refused but mix tokens through attention only: {refused_needlessly}"
    assert judged >= 100 and set(FAMILIES) <= set(mixing), (judged, mixing)
