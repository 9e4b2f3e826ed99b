"""The Hugging Face ``Trainer`` (and so Accelerate) with ``--deepspeed ds_config.json`` holding
``sequence_parallel_size: 2`` and ``context_parallel``, on 2 gloo ranks.

The reference is a *plain* transformers model (eager attention, no plugin) trained on one process
over the same samples in the same order, with the Trainer's loss convention (the token mean of
every optimizer step), SGD and the same clipping.  ``ContextParallelTrainer`` at SP=2 must reach
the same parameters (in memory and after ``save_model`` + ``from_pretrained``) and the same
evaluation loss.  Settings that conflict with SP raise ``ValueError`` before any collective.
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
import torch.distributed as dist

from dist_helper import run_cases, check_case
from reference import rel_err
from test_deepspeed_packed import _setup as ds_setup

pytest.importorskip("accelerate", reason="the Trainer path needs accelerate: pip install 'striped_sp[hf]'")

WORLD = 2
SEQ = 22
VOCAB = 61
BATCH, GA, SAMPLES, LR, CLIP = 2, 2, 8, 0.5, 0.3
_STATE = {}


def _setup():
    ds_setup()
    _STATE["tmp"] = os.environ["STRIPED_SP_TEST_TMP"]


def _tiny_llama(seed=4, attn="eager"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      attention_dropout=0.0, tie_word_embeddings=False, use_cache=False)
    model = LlamaForCausalLM(cfg)
    model.set_attn_implementation(attn)
    return model


class _Data(torch.utils.data.Dataset):
    """Rows of SEQ tokens; targets from the first token on, some ignored mid-row (uneven counts)."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.labels = self.ids.clone()
        for i in range(n):
            self.labels[i, 3: 3 + 2 * i] = -100

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _ds_json(stage, sp):
    cfg = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "train_batch_size": "auto", "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
           "sequence_parallel_size": sp, "context_parallel": {"algo": "striped", "backend": "auto"},
           "steps_per_print": 10**6}
    return cfg


def _args(out, stage, sp=2, **over):
    from transformers import TrainingArguments

    kw = dict(output_dir=out, per_device_train_batch_size=BATCH, per_device_eval_batch_size=BATCH,
              gradient_accumulation_steps=GA, learning_rate=LR, lr_scheduler_type="constant", optim="sgd",
              max_grad_norm=CLIP, num_train_epochs=1, train_sampling_strategy="sequential", report_to=[],
              logging_steps=1, save_strategy="no", deepspeed=_ds_json(stage, sp), use_cpu=True,
              dataloader_pin_memory=False, seed=0)
    kw.update(over)
    return TrainingArguments(**kw)


def _reference(train, dev, ga=GA):
    """One process, plain eager model: per step the token mean over its ``ga * BATCH`` samples."""
    model = _tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    per_step, norms = BATCH * ga, []
    for start in range(0, len(train), per_step):
        rows = [train[i] for i in range(start, start + per_step)]
        count = sum(int((r["labels"][1:] != -100).sum()) for r in rows)
        opt.zero_grad()
        for m in range(0, per_step, BATCH):
            micro = {k: torch.stack([r[k] for r in rows[m:m + BATCH]]) for k in rows[0]}
            out = model(input_ids=micro["input_ids"], labels=micro["labels"], num_items_in_batch=count)
            out.loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    with torch.no_grad():  # the Trainer's eval_loss: the mean of the per-batch mean losses
        losses = [model(**{k: torch.stack([dev[j][k] for j in range(i, i + BATCH)]) for k in ("input_ids", "labels")}).loss
                  for i in range(0, len(dev), BATCH)]
    return model, float(torch.stack(losses).mean()), norms


def _check_norms(trainer, ref_norms):
    """The Trainer's logged grad norms (before clipping, as DeepSpeed reports them) of its last steps
    equal the reference's: clipping is active (CLIP), so the parameters alone would not show a
    gradient off by a constant factor."""
    logged = [log["grad_norm"] for log in trainer.state.log_history if "grad_norm" in log]
    assert len(logged) >= len(ref_norms) and min(ref_norms) > CLIP, (logged, ref_norms)
    got = logged[-len(ref_norms):]
    assert all(abs(a - b) / b < 1e-4 for a, b in zip(got, ref_norms)), (got, ref_norms)


def _case_trainer(stage):
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    from striped_sp.deepspeed import ContextParallelTrainer

    AcceleratorState._reset_state(True)  # one Trainer after another in this process

    train, dev = _Data(SAMPLES, seed=1), _Data(4, seed=2)
    ref, ref_eval, ref_norms = _reference(train, dev)
    out = os.path.join(_STATE["tmp"], f"trainer_z{stage}")
    trainer = ContextParallelTrainer(model=_tiny_llama(attn="sdpa"), args=_args(out, stage, save_strategy="steps",
                                                                                save_steps=1),
                                     train_dataset=train, eval_dataset=dev)
    trainer.train()
    assert trainer.state.global_step == SAMPLES // (BATCH * GA)
    _check_norms(trainer, ref_norms)
    metrics = trainer.evaluate()
    assert abs(metrics["eval_loss"] - ref_eval) / ref_eval < 1e-4, (metrics["eval_loss"], ref_eval)
    trainer.save_model(out)
    dist.barrier()
    unset_hf_deepspeed_config()  # load as plain transformers (no zero.Init with this run's config)
    saved = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32)
    expected = dict(ref.named_parameters())
    for name, p in saved.named_parameters():
        assert rel_err(p.detach(), expected[name].detach()) < 1e-4, (name, rel_err(p, expected[name]))


class _Docs(torch.utils.data.Dataset):
    """Documents of uneven lengths (some shorter than the SP size), for DataCollatorWithFlattening."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, 15, (n,), generator=g).tolist()
        self.docs = [torch.randint(0, VOCAB, (n_,), generator=g).tolist() for n_ in lengths]

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        return {"input_ids": self.docs[i], "labels": list(self.docs[i])}


def _case_trainer_packed(stage):
    """Packed rows (DataCollatorWithFlattening) with gradient accumulation: the Trainer's target count
    of each step over the sharded batches, against a plain eager model on the flattened rows."""
    from accelerate.state import AcceleratorState
    from transformers import DataCollatorWithFlattening

    from striped_sp.deepspeed import ContextParallelTrainer

    AcceleratorState._reset_state(True)  # another Trainer in this process
    train, collator = _Docs(SAMPLES, seed=3), DataCollatorWithFlattening()
    ref = _tiny_llama()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    ref_norms = []
    for start in range(0, SAMPLES, BATCH * GA):
        micro = [collator([train[i] for i in range(m, m + BATCH)]) for m in range(start, start + BATCH * GA, BATCH)]
        count = sum(int((b["labels"][..., 1:] != -100).sum()) for b in micro)
        opt.zero_grad()
        for b in micro:
            ref(**b, num_items_in_batch=count).loss.backward()
        ref_norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)))
        opt.step()
    out = os.path.join(_STATE["tmp"], "trainer_packed")
    trainer = ContextParallelTrainer(model=_tiny_llama(attn="sdpa"), args=_args(out, stage),
                                     train_dataset=train, data_collator=collator)
    trainer.train()
    _check_norms(trainer, ref_norms)
    expected = dict(ref.named_parameters())
    for name, p in _params(trainer.model_wrapped).items():
        assert rel_err(p, expected[name].detach()) < 1e-4, (name, rel_err(p, expected[name]))


def _case_trainer_resume(stage):
    """A new Trainer (other initial weights) resumes the run's checkpoint-1 (skipping its batches in
    the epoch) and ends where the uninterrupted run and the reference ended."""
    from accelerate.state import AcceleratorState

    from striped_sp.deepspeed import ContextParallelTrainer

    AcceleratorState._reset_state(True)  # a second Trainer in this process
    train = _Data(SAMPLES, seed=1)
    ref, _, ref_norms = _reference(train, train)
    out = os.path.join(_STATE["tmp"], f"trainer_z{stage}")
    trainer = ContextParallelTrainer(model=_tiny_llama(seed=77, attn="sdpa"), args=_args(out, stage),
                                     train_dataset=train)
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))
    assert trainer.state.global_step == SAMPLES // (BATCH * GA)
    _check_norms(trainer, ref_norms[1:])  # the steps after the checkpoint
    expected = dict(ref.named_parameters())
    for name, p in _params(trainer.model_wrapped).items():
        assert rel_err(p, expected[name].detach()) < 1e-4, (name, rel_err(p, expected[name]))


def _case_accelerate():
    """An Accelerate script: the JSON in the DeepSpeed plugin, ``enable_accelerate``, ``prepare``."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DeepSpeedPlugin

    from striped_sp.deepspeed import enable_accelerate

    train = _Data(SAMPLES, seed=1)
    ref, _, ref_norms = _reference(train, train, ga=1)
    cfg = dict(_ds_json(2, 2), gradient_accumulation_steps=1, gradient_clipping=CLIP)
    AcceleratorState._reset_state(True)  # after the Trainers of this process
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"  # as `accelerate launch --use_deepspeed` sets it
    PartialState(cpu=True)  # CPU only: accelerate picks gloo only for a cpu state (TrainingArguments(use_cpu=True))
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
    settings = enable_accelerate(accelerator)
    assert settings.sequence_parallel_size == 2 and settings.layout == "striped"
    model = _tiny_llama(attn="sdpa")
    model, opt, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR),
                                             torch.utils.data.DataLoader(train, batch_size=BATCH))
    assert len(loader) == SAMPLES // BATCH  # one data-parallel replica: every sample on both ranks
    norms = []
    for batch in loader:
        loss = model(**batch).loss  # the global token mean of the micro-batch
        accelerator.backward(loss)  # DeepSpeed: backward and the engine's step
        opt.step()
        opt.zero_grad()
        norms.append(float(model.get_global_grad_norm()))
    assert all(abs(a - b) / b < 1e-4 for a, b in zip(norms, ref_norms)) and min(ref_norms) > CLIP, (norms, ref_norms)
    expected = dict(ref.named_parameters())
    for name, p in _params(model).items():
        assert rel_err(p, expected[name].detach()) < 1e-4, (name, rel_err(p, expected[name]))


def _params(engine):
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach() for n, p in engine.module.named_parameters()}


def _case_trainer_errors():
    from striped_sp.deepspeed import ContextParallelTrainer

    out = os.path.join(_STATE["tmp"], "bad")
    train = _Data(4, seed=1)
    bad = [
        (dict(average_tokens_across_devices=False), "average_tokens_across_devices=False"),
        (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0.1"),
        (dict(train_sampling_strategy="group_by_length"), "train_sampling_strategy='group_by_length'"),
        (dict(train_sampling_strategy="batch_rebalance"), "train_sampling_strategy='batch_rebalance'"),
        (dict(deepspeed=dict(_ds_json(2, 2), context_parallel={"algo": "striped", "heads": 2})),
         "context_parallel.heads: unknown key"),
        (dict(deepspeed=dict(_ds_json(2, 2), gradient_predivide_factor=2.0)), "gradient_predivide_factor=2.0"),
        (dict(deepspeed=dict(_ds_json(2, 2), sequence_parallel_size=3)),
         r"sequence_parallel_size=3 must divide the world size \(2\)"),
    ]
    for over, match in bad:
        with pytest.raises(ValueError, match=match):
            ContextParallelTrainer(model=_tiny_llama(), args=_args(out, 2, **over), train_dataset=train)
    dist.barrier()  # nobody hangs


def test_accelerator_cpu_true_is_named():
    """``Accelerator(cpu=True, deepspeed_plugin=...)``: accelerate drops the plugin; the error names cpu=True."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import DeepSpeedPlugin

    from striped_sp.deepspeed import enable_accelerate

    AcceleratorState._reset_state(True)
    use_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED")  # the Accelerator sets it
    try:
        accelerator = Accelerator(cpu=True, deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=dict(_ds_json(2, 1))))
        assert accelerator.state.deepspeed_plugin is None  # what accelerate does with cpu=True
        with pytest.raises(ValueError, match=r"Accelerator\(cpu=True\) drops the deepspeed_plugin"):
            enable_accelerate(accelerator)
    finally:
        AcceleratorState._reset_state(True)
        if use_deepspeed is None:
            os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
        else:
            os.environ["ACCELERATE_USE_DEEPSPEED"] = use_deepspeed


def _tiny_mistral(window, attn):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(6)
    cfg = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        attention_dropout=0.0, tie_word_embeddings=False, use_cache=False, sliding_window=window)
    model = MistralForCausalLM(cfg)
    model.set_attn_implementation(attn)
    return model


def _case_trainer_window():
    """A sliding-window model: the Trainer's loaders and attention run its window hint (stripes of 64 on
    rows of 256 tokens, window 40); one step equals a plain eager model's SGD step with the same clipping."""
    from accelerate.state import AcceleratorState

    from striped_sp.deepspeed import ContextParallelTrainer

    AcceleratorState._reset_state(True)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, VOCAB, (BATCH, 256), generator=g)
    train = [{"input_ids": ids[i], "labels": ids[i].clone()} for i in range(BATCH)]
    ref = _tiny_mistral(40, "eager")
    ref(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    expected = {n: (p - LR * p.grad).detach() for n, p in ref.named_parameters()}
    out = os.path.join(_STATE["tmp"], "trainer_window")
    trainer = ContextParallelTrainer(model=_tiny_mistral(40, "sdpa"), args=_args(out, 2, gradient_accumulation_steps=1),
                                     train_dataset=train)
    assert trainer.context_parallel.layout == "striped:window=40"
    trainer.train()
    assert trainer.accelerator._striped_sp.layout == "striped:window=40"
    assert trainer.state.global_step == 1
    for name, p in trainer.model.named_parameters():
        assert rel_err(p.detach(), expected[name]) < 1e-4, (name, rel_err(p.detach(), expected[name]))


def _tiny_hybrid(model_type, attn):
    """A hybrid family's tiny model, or gpt-oss (sinks, alternating windows of 8)."""
    from support.token_mixing import HYBRID_SHAPES, tiny_causal_lm
    from test_hf_sinks import GPT_OSS

    shape = {**HYBRID_SHAPES.get(model_type, {}), **(GPT_OSS if model_type == "gpt_oss" else {})}
    model, why = tiny_causal_lm(model_type, **{**shape, "use_cache": False, "tie_word_embeddings": False})
    assert model is not None, why
    model.set_attn_implementation(attn)
    return model.train()


def _case_trainer_hybrid(model_type):
    """A hybrid model (gated delta net / short convolution beside attention: its mixers run on the
    gathered sequence) or gpt-oss (sinks, the window hint from its layer types) under the Trainer;
    one clipped SGD step equals a plain eager model's."""
    from accelerate.state import AcceleratorState

    from striped_sp.deepspeed import ContextParallelTrainer

    AcceleratorState._reset_state(True)
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(3, 100, (BATCH, 32), generator=g)
    train = [{"input_ids": ids[i], "labels": ids[i].clone()} for i in range(BATCH)]
    ref = _tiny_hybrid(model_type, "eager")
    ref(input_ids=ids, labels=ids).loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    expected = {n: (p - LR * p.grad).detach() for n, p in ref.named_parameters()}
    out = os.path.join(_STATE["tmp"], f"trainer_{model_type}")
    trainer = ContextParallelTrainer(model=_tiny_hybrid(model_type, "eager" if model_type == "gpt_oss" else "sdpa"),
                                     args=_args(out, 2, gradient_accumulation_steps=1), train_dataset=train)
    if model_type == "gpt_oss":
        assert trainer.context_parallel.layout == "striped:window=8,global_every=2"
    trainer.train()
    assert trainer.state.global_step == 1
    for name, p in trainer.model.named_parameters():
        assert rel_err(p.detach(), expected[name]) < 1e-4, (name, rel_err(p.detach(), expected[name]))


CASES = [("setup", _setup, ()), ("trainer_errors", _case_trainer_errors, ()),
         ("trainer_zero2", _case_trainer, (2,)), ("trainer_zero2_resume", _case_trainer_resume, (2,)),
         ("trainer_zero3", _case_trainer, (3,)), ("trainer_zero2_packed", _case_trainer_packed, (2,)),
         ("accelerate_zero2", _case_accelerate, ()),
         ("trainer_window", _case_trainer_window, ()),
         ("trainer_lfm2", _case_trainer_hybrid, ("lfm2",)),
         ("trainer_qwen3_next", _case_trainer_hybrid, ("qwen3_next",)),
         ("trainer_gpt_oss", _case_trainer_hybrid, ("gpt_oss",))]  # each after the first resets accelerate's state


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ["STRIPED_SP_TEST_TMP"] = str(tmp_path_factory.mktemp("trainer"))
    return run_cases(WORLD, CASES, timeout_s=500)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_trainer_case(results, name):
    check_case(results, name)
