"""A plain ``transformers.Trainer`` / ``trl.SFTTrainer`` given the context-parallel JSON is refused
when it is built, naming the class to use (:mod:`striped_sp.deepspeed.trainer_guard`); ours pass.

One process, no collective: the trainers are only built (``Trainer.__init__`` ends with the guard),
never trained; ``deepspeed.initialize`` must not be reached.  Tiny models, seconds.
"""

import json
import os
import pathlib
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("deepspeed")
pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import striped_sp.deepspeed as ssd  # noqa: E402  (installs the guard)
from striped_sp.deepspeed import trainer_guard  # noqa: E402

EXAMPLES = pathlib.Path(__file__).resolve().parents[3] / "examples" / "deepspeed"
OURS = r"striped_sp\.deepspeed\.ContextParallelTrainer"
OURS_SFT = r"striped_sp\.deepspeed\.trl\.ContextParallelSFTTrainer"
VOCAB = 32

#: deepspeed.md's Trainer JSON (the one that failed DeepSpeed's batch assertion minutes in)
DOCS_TRAINER_JSON = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                     "train_batch_size": "auto", "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
                     "zero_optimization": {"stage": 3}, "sequence_parallel_size": 2,
                     "context_parallel": {"algo": "striped"}}


def _example(name):
    return json.loads((EXAMPLES / name).read_text())


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, attention_dropout=0.0))


@pytest.fixture
def no_engine(monkeypatch):
    """Building a Trainer must not reach DeepSpeed's engine (nor its ops)."""
    import deepspeed

    def reached(*args, **kwargs):
        raise AssertionError("deepspeed.initialize reached while building the trainer")

    monkeypatch.setattr(deepspeed, "initialize", reached)


def _args(tmp_path, config, cls=None, **over):
    cls = cls or transformers.TrainingArguments
    kw = dict(output_dir=str(tmp_path), deepspeed=config, per_device_train_batch_size=1,
              gradient_accumulation_steps=2, use_cpu=True, report_to=[], save_strategy="no")
    kw.update(over)
    return cls(**kw)


@pytest.mark.parametrize("config, said", [
    (_example("ds_config.json"), "sequence_parallel_size=2"),
    (_example("ds_config_trainer.json"), "sequence_parallel_size=2"),
    (DOCS_TRAINER_JSON, "sequence_parallel_size=2"),
    ({"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 0},
      "context_parallel": {"algo": "striped"}}, "without sequence_parallel_size"),
], ids=["example-json", "example-trainer-json", "docs-trainer-json", "no-sp-size"])
def test_a_plain_trainer_with_the_cp_json_is_refused_when_built_naming_our_class(tmp_path, no_engine, config, said):
    args = _args(tmp_path, json.loads(json.dumps(config)))
    with pytest.raises(ValueError, match=rf'"context_parallel" section, {said}\).*{OURS}'):
        transformers.Trainer(model=_tiny_llama(), args=args)


def test_a_json_file_path_is_read_too(tmp_path, no_engine):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(DOCS_TRAINER_JSON))
    with pytest.raises(ValueError, match=OURS):
        transformers.Trainer(model=_tiny_llama(), args=_args(tmp_path, str(path)))


@pytest.mark.parametrize("config", [
    None,
    {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 0}},
    {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 0}, "sequence_parallel_size": 1,
     "context_parallel": {"algo": "striped"}},
], ids=["no-deepspeed", "no-section", "section-at-sp-1"])
def test_a_plain_trainer_without_the_request_is_untouched(tmp_path, no_engine, config):
    trainer = transformers.Trainer(model=_tiny_llama(), args=_args(tmp_path, config))
    assert trainer.args.deepspeed is config or trainer.args.deepspeed == config


def test_our_trainer_passes_the_guard(tmp_path, no_engine, monkeypatch):
    from striped_sp.deepspeed import trainer

    monkeypatch.setattr(trainer, "_world_size", lambda args: 2)
    monkeypatch.setattr(trainer, "enable_accelerate", lambda *a, **k: None)  # no process group here
    built = trainer.ContextParallelTrainer(model=_tiny_llama(), args=_args(tmp_path, dict(DOCS_TRAINER_JSON)))
    assert built.context_parallel.sequence_parallel_size == 2
    with pytest.raises(ValueError, match=OURS):  # and the guard is still on for the next plain one
        transformers.Trainer(model=_tiny_llama(), args=_args(tmp_path, dict(DOCS_TRAINER_JSON)))


def _sft_inputs():
    pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<pad>")),
                                  pad_token="<pad>", eos_token="</s>")
    data = datasets.Dataset.from_dict({"input_ids": [[2, 3, 4, 5], [6, 7, 8]]})
    return tok, data


def test_a_plain_sft_trainer_is_refused_naming_the_sft_class(tmp_path, no_engine):
    tok, data = _sft_inputs()
    from trl import SFTConfig, SFTTrainer

    args = _args(tmp_path, dict(DOCS_TRAINER_JSON), cls=SFTConfig, packing=True, max_length=8, bf16=False)
    with pytest.raises(ValueError, match=OURS_SFT):
        SFTTrainer(model=_tiny_llama(), args=args, train_dataset=data, processing_class=tok)


def test_our_sft_trainer_passes_the_guard(tmp_path, no_engine, monkeypatch):
    tok, data = _sft_inputs()
    from trl import SFTConfig

    from striped_sp.deepspeed import trainer
    from striped_sp.deepspeed.trl import ContextParallelSFTTrainer

    monkeypatch.setattr(trainer, "_world_size", lambda args: 2)
    monkeypatch.setattr(trainer, "enable_accelerate", lambda *a, **k: None)
    args = _args(tmp_path, dict(DOCS_TRAINER_JSON), cls=SFTConfig, packing=True, max_length=8, bf16=False)
    built = ContextParallelSFTTrainer(model=_tiny_llama(), args=args, train_dataset=data, processing_class=tok)
    assert built.context_parallel.sequence_parallel_size == 2


def test_installing_is_idempotent():
    from transformers.trainer import DEFAULT_CALLBACKS

    ssd.trainer_guard.install_trainer_guard()
    ssd.trainer_guard.install_trainer_guard()
    assert [cb for cb in DEFAULT_CALLBACKS if getattr(cb, "striped_sp_guard", False)] == [trainer_guard.guard_class()]


def test_the_hook_runs_once_after_a_later_import_and_leaves_the_module_as_it_was(tmp_path, monkeypatch):
    """The mechanism that installs the guard when ``transformers.trainer`` is imported after
    ``striped_sp.deepspeed``, on a package of its own."""
    pkg = tmp_path / "guard_probe_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "late.py").write_text("VALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    trainer_guard.after_import("guard_probe_pkg.late", lambda m: seen.append(m.VALUE))
    trainer_guard.after_import("guard_probe_pkg.late", seen.append)
    assert trainer_guard._FINDER in sys.meta_path and seen == []
    try:
        import guard_probe_pkg.late as late

        assert seen == [7, late]
        assert type(late.__loader__).__name__ == "SourceFileLoader" and late.__spec__.loader is late.__loader__
        assert "guard_probe_pkg.late" not in trainer_guard._FINDER.hooks
        assert trainer_guard._FINDER.hooks or trainer_guard._FINDER not in sys.meta_path  # gone once none waits
        trainer_guard.after_import("guard_probe_pkg.late", lambda m: seen.append("now"))  # already imported: at once
        assert seen == [7, late, "now"]
    finally:
        for name in ("guard_probe_pkg.late", "guard_probe_pkg"):
            sys.modules.pop(name, None)
