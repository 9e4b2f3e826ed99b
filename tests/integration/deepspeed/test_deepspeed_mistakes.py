"""DeepSpeed users' mistakes named where they are made (no processes, nothing communicates):

* a ``context_parallel`` section without ``sequence_parallel_size`` (DeepSpeed would train at SP=1
  without a word): refused by every entry point, naming both keys; ``1`` written out passes;
* ``context_parallel.ulysses_size`` that does not split a transformers model's heads: refused at
  ``initialize`` / Trainer construction, naming the key and the head counts;
* the example scripts validate the config before their own batch arithmetic, so the documented
  errors surface.
"""

import importlib.util
import json
import os
import pathlib

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("deepspeed")

import striped_sp.deepspeed as ssd  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples" / "deepspeed"
MISSING = r'"context_parallel" section but no "sequence_parallel_size"'


def test_a_section_without_sequence_parallel_size_is_refused_naming_both_keys():
    with pytest.raises(ValueError, match=MISSING):
        ssd.check_requested({"context_parallel": {"algo": "striped"}})
    ssd.check_requested({"sequence_parallel_size": 1, "context_parallel": {"algo": "striped"}})  # a reference run
    ssd.check_requested({"train_micro_batch_size_per_gpu": 1})  # no section: plain DeepSpeed


def _no_collective(monkeypatch):
    import deepspeed

    def refuse(*args, **kwargs):
        raise AssertionError("initialize reached a collective before refusing the config")

    monkeypatch.setattr(deepspeed, "init_distributed", refuse)


def test_initialize_refuses_the_section_without_sequence_parallel_size(monkeypatch):
    _no_collective(monkeypatch)
    with pytest.raises(ValueError, match=MISSING):
        ssd.initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1,
                                                            "context_parallel": {"algo": "striped"}})


def _llama(heads, kv_heads):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8 * heads, intermediate_size=16,
                                        num_hidden_layers=1, num_attention_heads=heads,
                                        num_key_value_heads=kv_heads))


def test_ulysses_size_is_checked_against_the_heads_at_initialize(monkeypatch):
    pytest.importorskip("transformers")
    _no_collective(monkeypatch)
    cfg = {"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 2,
           "context_parallel": {"ulysses_size": 2}}
    with pytest.raises(ValueError, match=r"context_parallel\.ulysses_size=2 .*num_attention_heads=3, "
                                         r"num_key_value_heads=3\).*divide the query heads \(3\)"):
        ssd.initialize(model=_llama(3, 3), config=cfg)
    with pytest.raises(ValueError, match=r"context_parallel\.ulysses_size=2 .*num_key_value_heads=3"):
        ssd.initialize(model=_llama(6, 3), config=cfg)
    with pytest.raises(AssertionError, match="collective"):  # heads that fit: on to DeepSpeed
        ssd.initialize(model=_llama(4, 2), config=cfg)


def test_ulysses_size_is_checked_against_the_heads_when_the_trainer_is_built(monkeypatch, tmp_path):
    pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from striped_sp.deepspeed import trainer

    monkeypatch.setattr(trainer, "_world_size", lambda args: 2)
    cfg = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 0}, "sequence_parallel_size": 2,
           "context_parallel": {"ulysses_size": 2}}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), deepspeed=cfg, use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=r"context_parallel\.ulysses_size=2 .*num_attention_heads=3"):
        trainer.ContextParallelTrainer(model=_llama(3, 3), args=args)


def _example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("config, expected", [
    ({"sequence_parallel_size": 3}, r"sequence_parallel_size=3 must divide the world size \(2\)"),
    ({"sequence_parallel_size": 2, "context_parallel": {"ulysses_size": 3}}, r"context_parallel\.ulysses_size=3"),
    ({}, MISSING),
])
def test_the_example_lets_the_documented_errors_surface(monkeypatch, tmp_path, config, expected):
    example = _example("train")
    base = json.loads((EXAMPLES / "ds_config.json").read_text())
    base.pop("sequence_parallel_size")
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**base, **config}))

    def reached(*args, **kwargs):
        raise AssertionError("the example reached training with a config it should refuse")

    monkeypatch.setattr(example, "train", reached)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match=expected):
        example.main(example.parse_args(["--config", str(path)]))


# ---------------------------------------------------------------- it says it is on


def test_the_setup_line_names_layout_groups_kernel_stripes_and_cost_model(world_of_one):
    from types import SimpleNamespace

    from striped_sp.deepspeed.report import setup_line

    settings = ssd.parse_config({"sequence_parallel_size": 2, "context_parallel": {"stripe_size": "auto",
                                                                                   "ulysses_size": 2}})
    line = setup_line(_llama(4, 2), settings, SimpleNamespace(group=world_of_one, dp_size=3),
                      {"bf16": {"enabled": False}})
    for part in ("striped_sp on (DeepSpeed, context_parallel.algo striped): layout striped:stripe=auto",
                 "sequence_parallel_size 2 (ranks [0] of 1, 3 data-parallel replicas; Ulysses 2 x ring 1)",
                 "kernel torch on cpu (backend auto", "stripe size auto: per packed batch",
                 'not calibrated here ("calibrate": true measures it)'):
        assert part in line, (part, line)


def test_initialize_says_when_the_section_is_not_used(world_of_one, monkeypatch):
    import deepspeed

    from striped_sp.deepspeed import report

    said = []
    monkeypatch.setattr(report, "_say", lambda message: said.append(message))

    class Reached(Exception):
        pass

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(deepspeed, "initialize", reached)
    with pytest.raises(Reached):
        ssd.initialize(model=torch.nn.Linear(2, 2), config={"train_micro_batch_size_per_gpu": 1,
                                                            "sequence_parallel_size": 1,
                                                            "context_parallel": {"algo": "striped"}})
    assert said == ["striped_sp off: sequence_parallel_size 1, the context_parallel section is not used "
                    "(every rank a data-parallel replica)"]
