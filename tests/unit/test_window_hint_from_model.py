"""The striped default's window hint from a transformers model's config (striped_sp/deepspeed/window_hint.py):
the configs are transformers' own; the expected hints are written out by hand."""

from __future__ import annotations

import importlib
import types

import pytest

transformers = pytest.importorskip("transformers")

init_mod = importlib.import_module("striped_sp.deepspeed.initialize")
from striped_sp.deepspeed.config import ContextParallelSettings
from striped_sp.deepspeed.window_hint import model_window, with_model_window


def _model(config):
    """What the hint reads of a transformers model: its config (and that it is one)."""
    return types.SimpleNamespace(config=config, set_attn_implementation=lambda name: None)


@pytest.mark.parametrize("config, hint", [
    (transformers.MistralConfig(sliding_window=40), (40, None)),  # every layer windowed
    (transformers.MistralConfig(sliding_window=None), None),
    (transformers.Gemma3TextConfig(sliding_window=512, num_hidden_layers=6), (512, 6)),  # 5 local : 1 global
    (transformers.Gemma2Config(sliding_window=256, num_hidden_layers=4), (256, 2)),  # alternating
    (transformers.Qwen2Config(use_sliding_window=True, sliding_window=40, max_window_layers=1, num_hidden_layers=3),
     (40, 3)),  # one global layer in three
    (transformers.Qwen2Config(), None),  # use_sliding_window=False: no window
    (transformers.Qwen2Config(use_sliding_window=True, sliding_window=40, max_window_layers=2, num_hidden_layers=3),
     None),  # more global layers than sliding ones: no hint
    (transformers.LlamaConfig(), None),
])
def test_model_window(config, hint):
    assert model_window(_model(config)) == hint


def test_the_hint_applies_to_the_striped_default_only():
    model = _model(transformers.MistralConfig(sliding_window=4096))
    default = ContextParallelSettings(sequence_parallel_size=2)
    hinted = with_model_window(default, model)
    assert hinted.layout == "striped:window=4096" and default.layout == "striped"
    gemma = with_model_window(default, _model(transformers.Gemma3TextConfig(sliding_window=1024, num_hidden_layers=12)))
    assert gemma.layout == "striped:window=1024,global_every=6"
    for pinned in (ContextParallelSettings(sequence_parallel_size=2, stripe_size=1),
                   ContextParallelSettings(sequence_parallel_size=2, doc_placement="auto"),
                   ContextParallelSettings(sequence_parallel_size=2, algo="zigzag"),
                   ContextParallelSettings(sequence_parallel_size=1)):
        assert with_model_window(pinned, model) is pinned
    assert with_model_window(default, None) is default


def test_not_a_transformers_model():
    model = types.SimpleNamespace(config=transformers.MistralConfig(sliding_window=4096))  # a config of its own
    assert model_window(model) is None


def test_initialize_hints_only_where_it_builds_the_loader():
    """Loaders prepared before the model saw no model: initialize must run their layout, not the model's;
    without training_data the user shards in "striped" (the docs' shard_batch), so no hint."""
    model = _model(transformers.MistralConfig(sliding_window=4096))
    default = ContextParallelSettings(sequence_parallel_size=2)
    assert init_mod._with_window(default, model, training_data=[1]).layout == "striped:window=4096"
    assert init_mod._with_window(default, model, training_data=None).layout == "striped"
    token = init_mod.LOADER_WINDOW_HINT.set((None, None))
    try:
        assert init_mod._with_window(default, model, training_data=[1]).layout == "striped"
    finally:
        init_mod.LOADER_WINDOW_HINT.reset(token)
    token = init_mod.LOADER_WINDOW_HINT.set((4096, 6))
    try:
        assert init_mod._with_window(default, model, training_data=None).layout == "striped:window=4096,global_every=6"
    finally:
        init_mod.LOADER_WINDOW_HINT.reset(token)
