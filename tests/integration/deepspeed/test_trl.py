"""TRL's ``SFTTrainer`` with packing / padding-free batches at SP=2 (``--deepspeed`` JSON), on 2 gloo ranks.

The reference is a *plain* transformers model (eager attention, no plugin, none of our modules) on
one process that runs every document on its own (per-document SP=1): per optimizer step the summed
next-token losses of the step's documents over the step's target count, SGD and the same clipping.
``ContextParallelSFTTrainer`` must log the same loss and the same pre-clip gradient norm at every
step, and (padding-free case) the same evaluation loss.  The step's documents come from the
trainer's prepared dataset (TRL's packing), read in order (``train_sampling_strategy="sequential"``).
"""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.distributed as dist

from dist_helper import check_case, run_cases
from test_deepspeed_trainer import VOCAB, _ds_json, _setup, _tiny_llama

pytest.importorskip("trl", reason="the TRL path needs trl: pip install 'striped_sp[deepspeed,trl]'")
pytest.importorskip("datasets", reason="TRL's SFTTrainer needs datasets")

WORLD = 2
LR, CLIP = 0.5, 0.3


def _tokenizer():
    """A word-level tokenizer over the tiny vocabulary, built in memory (no hub)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "</s>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>")


def _documents(n, seed, longest):
    """``n`` tokenized documents of 1..longest tokens (some shorter than the SP size)."""
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (n,), generator=g).tolist()
    return Dataset.from_dict({"input_ids": [torch.randint(2, VOCAB, (k,), generator=g).tolist() for k in lengths]})


def _row_documents(row):
    """The documents of one prepared row: split by TRL's ``seq_lengths`` when packed."""
    ids = list(row["input_ids"])
    out, start = [], 0
    for k in row.get("seq_lengths") or [len(ids)]:
        out.append(ids[start:start + k])
        start += k
    return out


def _doc_loss_sum(model, doc):
    """The summed next-token loss of one document on its own (plain eager model, SP=1)."""
    if len(doc) < 2:
        return torch.zeros(())
    ids = torch.tensor([doc])
    logits = model(input_ids=ids).logits[0, :-1].double()
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")


def _tiny_gpt_oss(attn="eager"):
    """transformers' gpt-oss at a tiny shape: sinks away from zero, windows of 8 alternating with
    global layers (test_hf_sinks.py), the vocabulary of these tests."""
    from test_hf_sinks import _model

    model = _model(vocab_size=VOCAB, router_aux_loss_coef=0.0)  # refused under SP otherwise (its own test)
    model.set_attn_implementation("eager")  # gpt-oss takes no sdpa; ours replaces it under SP
    return model


def _conv_keeping_documents(x, weight, bias=None, activation=None, seq_idx=None, **kwargs):
    """A causal depthwise convolution that restarts at every document of ``seq_idx`` ``[b, s]`` (what
    causal-conv1d does on CUDA; transformers' CPU fallback refuses packed rows): ``x`` ``[b, c, s]``,
    ``weight`` ``[c, K]``, written here (no module of ours)."""
    from transformers.activations import ACT2FN

    k, s = weight.size(-1), x.size(-1)
    out = torch.zeros_like(x) if bias is None else bias[None, :, None].expand_as(x).clone()
    for j in range(k):  # tap j reads the token j steps back, inside the same document only
        shifted = torch.nn.functional.pad(x, (j, 0))[..., :s]
        if seq_idx is not None and j:
            same = torch.nn.functional.pad(seq_idx, (j, 0), value=-1)[..., :s] == seq_idx
            shifted = shifted * same[:, None, :].to(x.dtype)
        out = out + weight[:, k - 1 - j][None, :, None] * shifted
    return ACT2FN[activation](out) if activation is not None else out


def _tiny_lfm2(attn="eager"):
    """transformers' LFM2 at a tiny shape (a short convolution, then attention), weights off their init;
    its convolution keeps packed documents apart (:func:`_conv_keeping_documents`)."""
    import transformers.models.lfm2.modeling_lfm2 as lfm2

    from test_deepspeed_trainer import _tiny_hybrid

    lfm2.causal_conv1d_fn = _conv_keeping_documents
    return _tiny_hybrid("lfm2", attn).float()


MODELS = {"llama": _tiny_llama, "gpt_oss": _tiny_gpt_oss, "lfm2": _tiny_lfm2}


def _reference(rows, batch, ga, model_name="llama"):
    """Per optimizer step of ``batch * ga`` prepared rows: (loss, pre-clip grad norm), per document."""
    model = MODELS[model_name]()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses, norms = [], []
    for start in range(0, len(rows), batch * ga):
        docs = [d for row in rows[start:start + batch * ga] for d in _row_documents(row)]
        count = sum(len(d) - 1 for d in docs)
        opt.zero_grad()
        total = sum(_doc_loss_sum(model, d) for d in docs) / count
        total.backward()
        losses.append(float(total))
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        opt.step()
    return model, losses, norms


def _eval_reference(model, rows, batch):
    """The Trainer's eval loss: the mean over micro-batches of each micro-batch's token mean."""
    means = []
    with torch.no_grad():
        for start in range(0, len(rows), batch):
            docs = [d for row in rows[start:start + batch] for d in _row_documents(row)]
            means.append(float(sum(_doc_loss_sum(model, d) for d in docs) / sum(len(d) - 1 for d in docs)))
    return sum(means) / len(means)


def _config(out, batch, ga, **over):
    from trl import SFTConfig

    kw = dict(output_dir=out, per_device_train_batch_size=batch, per_device_eval_batch_size=batch,
              gradient_accumulation_steps=ga, learning_rate=LR, lr_scheduler_type="constant", optim="sgd",
              max_grad_norm=CLIP, num_train_epochs=1, train_sampling_strategy="sequential", report_to=[],
              logging_steps=1, save_strategy="no", deepspeed=_ds_json(2, 2), use_cpu=True, bf16=False,
              gradient_checkpointing=False, dataloader_pin_memory=False, seed=0)
    kw.update(over)
    return SFTConfig(**kw)


def _rel(a, b):
    return abs(a - b) / abs(b)


def _eval_targets_per_rank(trainer):
    """Per eval micro-batch, every rank's count of counted (not ignored) targets."""
    counts = []
    for batch in trainer.get_eval_dataloader():
        labels = batch["shift_labels"] if "shift_labels" in batch else batch["labels"]
        mine = (labels != -100).sum().reshape(1)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        counts.append([int(c) for c in every])
    return counts


def _case_sft(name, batch, ga, n_docs, longest, dev_lengths=None, model_name="llama", **sft):
    """SFTTrainer at SP=2 against the per-document reference: loss and grad norm of every step.
    ``dev_lengths``: the evaluation documents' lengths (else 4 random ones)."""
    from accelerate.state import AcceleratorState

    from striped_sp.deepspeed.trl import ContextParallelSFTTrainer

    AcceleratorState._reset_state(True)  # one trainer after another in this process
    train = _documents(n_docs, seed=11, longest=longest)
    dev = _documents(4, seed=12, longest=longest) if sft.get("padding_free") else None
    if dev_lengths is not None:
        from datasets import Dataset

        g = torch.Generator().manual_seed(12)
        dev = Dataset.from_dict({"input_ids": [torch.randint(2, VOCAB, (k,), generator=g).tolist() for k in dev_lengths]})
    out = os.path.join(os.environ["STRIPED_SP_TEST_TMP"], name)
    trainer = ContextParallelSFTTrainer(model=MODELS[model_name](attn="sdpa"), args=_config(out, batch, ga, **sft),
                                        train_dataset=train, eval_dataset=dev, processing_class=_tokenizer())
    torch.set_num_threads(1)  # accelerate's CPU state set it to the core count
    rows = [trainer.train_dataset[i] for i in range(len(trainer.train_dataset))]
    if sft.get("packing"):
        assert max(len(r["seq_lengths"]) for r in rows) > 1, "no row holds two documents"
    dev_rows = [trainer.eval_dataset[i] for i in range(len(trainer.eval_dataset))] if dev is not None else None
    if dev_lengths is not None:  # the case's point: the ranks count different numbers of targets
        counts = _eval_targets_per_rank(trainer)
        assert [len(r["input_ids"]) for r in dev_rows] == list(dev_lengths)
        assert counts and all(a == 3 * b > 0 for a, b in counts), counts
    expected = [None]
    if dist.get_rank() == 0:  # the reference once, on one process
        ref, ref_losses, ref_norms = _reference(rows, batch, ga, model_name)
        expected = [(ref_losses, ref_norms, _eval_reference(ref, dev_rows, batch) if dev_rows else None)]
    dist.broadcast_object_list(expected, src=0)
    ref_losses, ref_norms, ref_eval = expected[0]
    trainer.train()
    logs = [log for log in trainer.state.log_history if "grad_norm" in log]
    got_losses, got_norms = [log["loss"] for log in logs], [log["grad_norm"] for log in logs]
    assert len(logs) == len(ref_losses) >= 3 and min(ref_norms) > CLIP, (len(logs), ref_norms)
    assert all(_rel(a, b) < 1e-4 for a, b in zip(got_losses, ref_losses)), (got_losses, ref_losses)
    assert all(_rel(a, b) < 1e-4 for a, b in zip(got_norms, ref_norms)), (got_norms, ref_norms)
    if dev is not None:
        got = trainer.evaluate()["eval_loss"]
        assert _rel(got, ref_eval) < 1e-4, (got, ref_eval)


def _case_errors():
    """Settings that conflict with SP raise ValueError on every rank, before any collective."""
    from striped_sp.deepspeed.trl import ContextParallelSFTTrainer

    out = os.path.join(os.environ["STRIPED_SP_TEST_TMP"], "bad")
    train = _documents(4, seed=1, longest=6)
    with pytest.raises(ValueError, match="label_smoothing_factor=0.1"):
        ContextParallelSFTTrainer(model=_tiny_llama(), args=_config(out, 2, 1, label_smoothing_factor=0.1),
                                  train_dataset=train, processing_class=_tokenizer())
    dist.barrier()  # nobody hangs


def test_padding_free_collator_batch_is_sharded():
    """TRL's padding-free batch through shard_batch: every rank's tokens with their targets inside
    their document and their document index (``seq_idx``), against the documents themselves."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    from striped_sp.deepspeed import shard_batch
    from striped_sp.plan.layouts import positions

    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(2, VOCAB, (k,), generator=g).tolist() for k in (3, 1, 6, 2, 1)]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True)([{"input_ids": d} for d in docs])
    flat = [t for d in docs for t in d]
    doc_of = [i for i, d in enumerate(docs) for _ in d] + [len(docs)]  # the row's padding: one more document
    target = [d[j + 1] if j + 1 < len(d) else -100 for d in docs for j in range(len(d))] + [-100]
    for rank in range(2):
        local = shard_batch(batch, 2, rank)
        bounds = local["cu_seq_lens_q"].tolist()
        assert bounds == [0, 3, 4, 10, 12, 13, 14]
        idx = positions(14, 2, rank, "striped", bounds).tolist()
        assert local["input_ids"][0].tolist() == [(flat + [0])[i] for i in idx]
        assert local["labels"][0].tolist() == [target[i] for i in idx]
        assert local["seq_idx"][0].tolist() == [doc_of[i] for i in idx]
        assert local["position_ids"][0].tolist() == [i - bounds[doc_of[i]] for i in idx]
        assert int(local["num_items_in_batch"]) == sum(len(d) - 1 for d in docs)


def test_import_error_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "trl", None)  # as if trl were not installed
    monkeypatch.delitem(sys.modules, "striped_sp.deepspeed.trl", raising=False)
    with pytest.raises(ImportError, match=r"pip install 'striped_sp\[deepspeed,trl\]'"):
        import striped_sp.deepspeed.trl  # noqa: F401


def test_router_loss_refused():
    """A MoE load-balancing loss under SP is refused, naming router_aux_loss_coef (0 turns it off)."""
    from types import SimpleNamespace

    from striped_sp.deepspeed.trl import _check_router_loss

    moe = SimpleNamespace(config=SimpleNamespace(output_router_logits=False, router_aux_loss_coef=0.02))
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.02"):
        _check_router_loss(moe, SimpleNamespace(router_aux_loss_coef=None))
    _check_router_loss(moe, SimpleNamespace(router_aux_loss_coef=0.0))
    dense = SimpleNamespace(config=SimpleNamespace())
    _check_router_loss(dense, SimpleNamespace(router_aux_loss_coef=0.5))


def _case_packing():
    _case_sft("packing", 2, 2, 30, 9, packing=True, max_length=16)


def _case_packing_gpt_oss():
    """gpt-oss (sinks, windows of 8 / global) with TRL packing: the window hint and the sinks on
    packed rows, every step's loss and grad norm against the per-document reference."""
    _case_sft("packing_gpt_oss", 2, 2, 40, 9, model_name="gpt_oss", packing=True, max_length=16)


def _case_packing_hybrid():
    """LFM2 (a short convolution split over the ranks, then attention) with TRL packing: every step's loss
    and grad norm against the per-document reference; the documents' seq_idx reaches the split
    convolution in natural order (a convolution that keeps documents apart stands in for causal-conv1d)."""
    _case_sft("packing_lfm2", 2, 2, 30, 9, model_name="lfm2", packing=True, max_length=16)


def _case_padding_free():
    _case_sft("padding_free", 3, 1, 12, 11, padding_free=True, max_length=None)


def _case_eval_uneven_targets():
    """The eval loss when the ranks hold different numbers of counted targets: micro-batches of a
    2-token and a 4-token document make one padding-free row of 6, of whose 4 targets (the last
    token of a document has none) the striped layout deals 3 to rank 0 and 1 to rank 1.  The
    micro-batch's loss is the mean over its 4 targets, not the mean of the ranks' means."""
    _case_sft("eval_uneven", 2, 1, 6, 7, dev_lengths=(2, 4, 2, 4), padding_free=True, max_length=None)


CASES = [("setup", _setup, ()), ("errors", _case_errors, ()), ("packing_bfd", _case_packing, ()),
         ("packing_gpt_oss", _case_packing_gpt_oss, ()), ("packing_lfm2", _case_packing_hybrid, ()),
         ("padding_free", _case_padding_free, ()),
         ("eval_uneven_targets", _case_eval_uneven_targets, ())]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    os.environ["STRIPED_SP_TEST_TMP"] = str(tmp_path_factory.mktemp("trl"))
    return run_cases(WORLD, CASES, timeout_s=300)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_trl_case(results, name):
    check_case(results, name)
