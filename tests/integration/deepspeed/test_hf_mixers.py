"""Hybrid models on the Hugging Face path: nothing silently wrong.

A transformers model's token mixers other than attention are found by what the model contains
(:mod:`striped_sp.deepspeed.mixers`).  Those a module holds (gated delta net, Mamba / Mamba2,
short convolution) run on the gathered sequence (exactness: ``test_hf_hybrids.py``); the others (a
linear attention known only from ``layer_types``, a chunked attention, a model without attention)
are refused by every route that would run them under context parallelism, naming the model class,
the layer and the kind, before any collective.  The walk at the end judges the rule by a probe
that knows no rule (:mod:`support.token_mixing`): every causal LM class of the installed
transformers that mixes tokens outside attention must be found, and no other one.
"""

import os
import re
import types

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

import striped_sp.deepspeed as ssd  # noqa: E402
from striped_sp.deepspeed.mixers import check_model_mixers, unhandled_mixers  # noqa: E402
from support.token_mixing import HYBRID_SHAPES as SHAPES, mixes_tokens_outside_attention, tiny_causal_lm  # noqa: E402

transformers.logging.set_verbosity_error()

#: model type -> the mixer class the refusal must name (one per family the issue names)
FAMILIES = {
    "qwen3_next": "Qwen3NextGatedDeltaNet",
    "jamba": "JambaMambaMixer",
    "falcon_h1": "FalconH1Mixer",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "lfm2": "Lfm2ShortConv",
}
CONFIG = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2, "zero_optimization": {"stage": 0},
          "context_parallel": {"algo": "striped"}}


def _model(model_type):
    model, why = tiny_causal_lm(model_type, **SHAPES.get(model_type, {}))
    if model is None:
        pytest.skip(f"{model_type}: {why}")
    return model


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_enabling_the_attention_runs_a_hybrids_mixers_on_the_gathered_sequence(model_type):
    """The mixers the rule finds are the ones wrapped (exactness: test_hf_hybrids.py)."""
    model = _model(model_type)
    found = unhandled_mixers(model)
    assert found and all(m.runnable for m in found), [m.describe() for m in found]
    assert FAMILIES[model_type] in {m.kind for m in found}
    ssd.enable_hf_attention(model, None, "striped")
    modules = dict(model.named_modules())
    assert all(getattr(modules[m.path].forward, "_striped_sp_mixer", None) == m.path for m in found)
    assert model.config._attn_implementation == "striped_sp"


#: tiny configs of models with a mixer no module holds: MiniMax's linear attention (a layer type),
#: Llama 4's chunked attention (a mask), and a model with no attention at all (xLSTM)
REFUSED = {"minimax": (r"layer 1 config\.layer_types\[1\] \(linear_attention: ", {"num_hidden_layers": 2}),
           "llama4_text": (r"layer 0 config\.layer_types\[0\] \(chunked_attention: ", {"num_hidden_layers": 2}),
           "xlstm": (r"config\.model \(xLSTMForCausalLM: no module calls transformers' attention functions",
                     {"num_hidden_layers": 2})}


def _refused(model_type):
    model, why = tiny_causal_lm(model_type, **REFUSED[model_type][1])
    if model is None:
        pytest.skip(f"{model_type}: {why}")
    return model


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_enabling_the_attention_refuses_a_mixer_it_cannot_run_naming_class_layer_and_kind(model_type):
    model = _refused(model_type)
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=f"{type(model).__name__} mixes tokens outside attention") as err:
        ssd.enable_hf_attention(model, None, "striped")
    assert re.search(REFUSED[model_type][0], str(err.value)), str(err.value)
    assert "sequence_parallel_size=1" in str(err.value)
    assert model.config._attn_implementation == before  # refused before anything was switched
    assert not any(hasattr(m.forward, "_striped_sp_mixer") for m in model.modules())  # nothing wrapped


def _no_collective(monkeypatch):
    import deepspeed

    def refuse(*args, **kwargs):
        raise AssertionError("a collective was reached before the model was refused")

    monkeypatch.setattr(deepspeed, "init_distributed", refuse)


def test_initialize_refuses_before_any_collective_and_lets_a_runnable_hybrid_through(monkeypatch):
    _no_collective(monkeypatch)
    with pytest.raises(ValueError, match="MiniMaxForCausalLM mixes tokens outside attention"):
        ssd.initialize(model=_refused("minimax"), config=dict(CONFIG))
    with pytest.raises(AssertionError, match="collective"):  # gathered mixers: on to DeepSpeed
        ssd.initialize(model=_model("lfm2"), config=dict(CONFIG))
    with pytest.raises(AssertionError, match="collective"):  # without SP the model is DeepSpeed's
        ssd.initialize(model=_refused("minimax"), config={**CONFIG, "sequence_parallel_size": 1})


def test_the_trainer_and_accelerate_refuse_when_built(monkeypatch, tmp_path):
    pytest.importorskip("accelerate")
    from striped_sp.deepspeed import trainer

    monkeypatch.setattr(trainer, "_world_size", lambda args: 2)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), deepspeed={**CONFIG, "train_micro_batch_size_per_gpu": "auto"},
                                          use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match="Llama4ForCausalLM mixes tokens outside attention"):
        trainer.ContextParallelTrainer(model=_refused("llama4_text"), args=args)
    accelerator = types.SimpleNamespace(num_processes=2, split_batches=False, parallelism_config=None)
    with pytest.raises(ValueError, match="xLSTMForCausalLM mixes tokens outside attention"):
        ssd.enable_accelerate(accelerator, config=dict(CONFIG), model=_refused("xlstm"))


def _llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, **config))


def test_an_unknown_mixer_is_found_by_what_it_contains_not_by_its_name():
    model = _llama()
    assert unhandled_mixers(model) == []  # attention only
    model.model.layers[1].token_shift = torch.nn.Conv1d(32, 32, kernel_size=2, groups=32)  # no known name
    model.model.layers[2].mlp.A_log = torch.nn.Parameter(torch.zeros(4))
    assert [(m.layer, m.path, m.kind, m.runnable) for m in unhandled_mixers(model)] == [
        (1, "model.layers.1.token_shift", "Conv1d", True), (2, "model.layers.2.mlp", "LlamaMLP", True)]
    assert "a Conv1d of kernel 2 over the sequence" in unhandled_mixers(model)[0].describe()


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


@pytest.mark.release  # a sweep over every installed causal LM (make test-release); make test keeps the families
def test_every_causal_lm_that_mixes_tokens_outside_attention_is_found():
    """Exact or refused by name, over the whole installed transformers: the probe decides which
    classes mix tokens outside attention; the rule must find every one of those (each then runs
    gathered or is refused), and must not call a model that attends attention-free (a layer type
    the ring does not run, a chunked attention, is refused with or without mixing; a convolution
    module the probe did not see mix, Inkling 2's, is gathered: exact, at the gather's cost).
    Two layers each (the probe needs no more; each class's own layer pattern from index 0)."""
    judged, mixing, missed, needless = 0, [], [], []
    for model_type in _causal_lm_types():
        model, _ = tiny_causal_lm(model_type, **SHAPES.get(model_type, {"num_hidden_layers": 2}))
        if model is None:
            continue
        found = unhandled_mixers(model)
        mixes = mixes_tokens_outside_attention(model)
        if mixes is None:  # does not run, or never takes our attention (enable_hf_attention refuses it)
            continue
        judged += 1
        if mixes:
            mixing.append(model_type)
            if not found:
                missed.append(model_type)
        elif any(m.path == "config.model" for m in found):  # refused as attention-free, yet it attends
            needless.append((model_type, [m.describe() for m in found][:2]))
    assert not missed, f"mix tokens outside attention and nothing in them is found: {missed}"
    assert not needless, f"mixers found in models that mix tokens through attention only: {needless}"
    assert judged >= 100 and set(FAMILIES) <= set(mixing), (judged, mixing)
