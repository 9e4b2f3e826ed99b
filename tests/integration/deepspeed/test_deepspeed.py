"""DeepSpeed adapter, no processes: the config section, the data adapter, argument checks."""

import json
import re
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from striped_sp import positions
from striped_sp.deepspeed import (
    ContextParallelSettings,
    DistributedAttention,
    parse_config,
    shard_batch,
)

# ---------------------------------------------------------------------------------- config


def test_config_defaults():
    s = parse_config({"train_micro_batch_size_per_gpu": 1})
    assert s == ContextParallelSettings(sequence_parallel_size=1, algo="striped", backend="auto")
    assert not s.enabled and s.layout == "striped"
    s = parse_config({"sequence_parallel_size": 2, "context_parallel": {}}, world_size=2)
    assert s.enabled and s.algo == "striped" and s.backend == "auto"
    # DeepSpeed's convention: "auto" means the default
    assert parse_config({"context_parallel": {"algo": "auto", "backend": "auto"}}).algo == "striped"


@pytest.mark.parametrize("algo,layout", [("striped", "striped"), ("zigzag", "zigzag"), ("ring", "contiguous")])
def test_config_algos(algo, layout):
    s = parse_config({"sequence_parallel_size": 4, "context_parallel": {"algo": algo, "backend": "math"}}, world_size=8)
    assert (s.sequence_parallel_size, s.algo, s.layout, s.backend) == (4, algo, layout, "math")


def test_config_from_json_file(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"sequence_parallel_size": 2, "context_parallel": {"algo": "zigzag"}}))
    assert parse_config(str(path), world_size=2).layout == "zigzag"


@pytest.mark.parametrize(
    "config,world_size,words",
    [
        ({"context_parallel": {"algo": "ulysses"}}, None, ["context_parallel.algo", "'striped', 'zigzag' or 'ring'"]),
        ({"context_parallel": {"algo": 3}}, None, ["context_parallel.algo"]),
        ({"context_parallel": {"backend": "cuda"}}, None, ["context_parallel.backend", "'math'"]),
        ({"context_parallel": {"algo": "striped", "chunks": 4}}, None, ["context_parallel.chunks", "unknown key", "algo, backend"]),
        ({"sequence_parallel_size": 4, "context_parallel": {"ulysses_size": 3}}, 4,
         ["context_parallel.ulysses_size=3", "sequence_parallel_size=4",
          "ulysses_size=3 must divide the context-parallel size 4"]),
        ({"sequence_parallel_size": 4, "context_parallel": {"ulysses_size": 8}}, 4,
         ["context_parallel.ulysses_size=8", "ulysses_size=8 must divide the context-parallel size 4"]),
        ({"context_parallel": {"algo": "ring", "doc_placement": 8}}, None,
         ["context_parallel.doc_placement=8", "not 'ring'", "apply to layout 'striped' only"]),
        ({"context_parallel": {"algo": "zigzag", "stripe_size": 4}}, None,
         ["context_parallel.stripe_size=4", "not 'zigzag'", "apply to layout 'striped' only"]),
        ({"sequence_parallel_size": 4, "context_parallel": {"ulysses_size": 0}}, 4, ["context_parallel.ulysses_size"]),
        ({"sequence_parallel_size": 4, "context_parallel": {"ulysses_size": "2"}}, 4, ["context_parallel.ulysses_size"]),
        ({"sequence_parallel_size": 4, "context_parallel": {"ulysses_size": True}}, 4, ["context_parallel.ulysses_size"]),
        ({"context_parallel": ["striped"]}, None, ["context_parallel", "JSON object"]),
        ({"sequence_parallel_size": 0}, None, ["sequence_parallel_size=0", "positive integer"]),
        ({"sequence_parallel_size": "2"}, None, ["sequence_parallel_size='2'", "positive integer"]),
        ({"sequence_parallel_size": 3}, 4, ["sequence_parallel_size=3", "divide the world size (4)"]),
        ({"sequence_parallel_size": 8}, 4, ["sequence_parallel_size=8", "divide the world size (4)"]),
        ({"sequence_parallel_size": 2, "data_parallel_size": 3}, 4, ["data_parallel_size=3", "world size (4)"]),
        ("/no/such/ds_config.json", None, ["dict or the path of a JSON file"]),
    ],
)
def test_config_errors(config, world_size, words):
    with pytest.raises(ValueError) as err:
        parse_config(config, world_size=world_size)
    for w in words:
        assert w in str(err.value)


def test_config_striped_parameters_make_one_layout_key():
    cp = {"algo": "striped", "stripe_size": 4, "doc_placement": "auto"}
    s = parse_config({"sequence_parallel_size": 2, "context_parallel": cp}, world_size=2)
    assert (s.stripe_size, s.doc_placement, s.layout) == (4, "auto", "striped:stripe=4,place=auto")
    assert parse_config({"context_parallel": {"doc_placement": 64}}).layout == "striped:place=64"
    # a stripe size given pins it; none given: the default, the per-batch search (issue 36)
    assert parse_config({"context_parallel": {"stripe_size": 1, "doc_placement": "split"}}).layout == "striped:stripe=1"
    assert parse_config({"context_parallel": {"stripe_size": 1}}).layout == "striped:stripe=1"
    assert parse_config({"context_parallel": {"algo": "striped"}}).layout == "striped"
    assert parse_config({"context_parallel": {"algo": "zigzag", "stripe_size": 1}}).layout == "zigzag"
    assert parse_config({"context_parallel": {"stripe_size": "doc", "doc_placement": 8}}).layout \
        == "striped:stripe=doc,place=8"


@pytest.mark.parametrize("section,words", [
    ({"stripe_size": 0}, ["context_parallel.stripe_size=0", "a positive integer, 'doc'", "or 'auto'"]),
    ({"stripe_size": "4"}, ["context_parallel.stripe_size='4'", "integer"]),
    ({"stripe_size": "docs"}, ["context_parallel.stripe_size='docs'", "integer, 'doc'"]),
    ({"stripe_size": True}, ["context_parallel.stripe_size=True"]),
    ({"stripe_size": 2.5}, ["context_parallel.stripe_size=2.5"]),
    ({"doc_placement": "whole"}, ["context_parallel.doc_placement='whole'", "'split', 'auto' or a positive integer"]),
    ({"doc_placement": 0}, ["context_parallel.doc_placement=0", "positive integer"]),
    ({"doc_placement": "64"}, ["context_parallel.doc_placement='64'"]),
    ({"doc_placement": True}, ["context_parallel.doc_placement=True"]),
    ({"algo": "zigzag", "stripe_size": 2}, ["context_parallel.stripe_size=2", "algo='striped' only, not 'zigzag'"]),
    ({"algo": "ring", "doc_placement": "auto"}, ["context_parallel.doc_placement='auto'", "not 'ring'"]),
])
def test_config_striped_parameter_errors(section, words):
    with pytest.raises(ValueError) as err:
        parse_config({"context_parallel": section})
    for w in words:
        assert w in str(err.value)


# ---------------------------------------------------------------------------- data adapter


def _full_batch(b=3, seq=40, vocab=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (b, seq), generator=g)
    labels = ids.clone()
    labels[1, :3] = -100  # e.g. a prompt that does not count; rows 0 and 2 count from the first token
    labels[0, seq // 2 - 1] = -100
    return {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids), "sample_id": "x"}


@pytest.mark.parametrize("layout", ["striped", "zigzag", "contiguous"])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_shard_batch_keeps_every_label_once(layout, n):
    full = _full_batch()
    seq = full["input_ids"].size(1)
    expected = torch.cat([full["labels"][:, 1:], torch.full((3, 1), -100)], dim=1)
    seen = torch.zeros(3, seq, dtype=torch.int64)
    got = torch.full((3, seq), -7)
    for r in range(n):
        part = shard_batch(full, n, r, layout)
        pos = positions(seq, n, r, layout)
        assert "attention_mask" not in part and part["sample_id"] == "x"
        assert torch.equal(part["position_ids"], pos.expand(3, -1))
        assert torch.equal(part["input_ids"], full["input_ids"][:, pos])
        assert part["labels"] is part["shift_labels"]
        assert int(part["num_items_in_batch"]) == int((expected != -100).sum())
        seen[:, pos] += 1
        got[:, pos] = part["shift_labels"]
    assert bool((seen == 1).all())  # every target exactly once
    assert torch.equal(got, expected)  # and each with its own token (shifted on the full sequence)


def test_shard_batch_keeps_given_positions_and_shift_labels():
    full = _full_batch(seq=16)
    full["position_ids"] = torch.arange(100, 116).expand(3, -1)
    full["shift_labels"] = full.pop("labels")  # already shifted: taken as they are
    part = shard_batch(full, 2, 1, "striped:stripe=1")  # the paper's layout, pinned (issue 57's default may mirror)
    assert torch.equal(part["position_ids"][0], torch.arange(101, 116, 2))
    assert torch.equal(part["shift_labels"], full["shift_labels"][:, 1::2])


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda b: b.update(input_ids=b["input_ids"][:, :30], labels=b["labels"][:, :30]) or b.pop("attention_mask"),
         ["batch['input_ids'] has 30 tokens", "multiple of"]),
        (lambda b: b["attention_mask"].__setitem__((0, 0), 0), ["attention_mask", "right padding", "row 0"]),
        (lambda b: b["attention_mask"].__setitem__((1, 7), 0), ["attention_mask", "hole", "row 1"]),
        (lambda b: b.update(position_ids=torch.tensor([0, 1, 2, 5] * 10).expand(3, -1)),
         ["position_ids", "row 0 at token 3", "restart at 0"]),
        (lambda b: b.update(position_ids=torch.tensor([3, 4, 0, 1] * 10).expand(3, -1)),
         ["position_ids", "row 0 at token 0"]),
        (lambda b: b.update(cu_seq_lens_q=torch.tensor([0, 8, 40])), ["cu_seq_lens_q", "batch size 3"]),
        (lambda b: b.update(labels=b["labels"][:, :-2]), ["batch['labels']", "dim 1"]),
        (lambda b: b.pop("input_ids"), ["input_ids"]),
    ],
)
def test_shard_batch_errors(change, words):
    batch = _full_batch(seq=40)
    change(batch)
    with pytest.raises(ValueError) as err:
        shard_batch(batch, 4, 0, "zigzag")  # 40 = 5 * 2 * 4; 30 is not a multiple of 8
    for w in words:
        assert w in str(err.value)


# ------------------------------------------------------------------ DistributedAttention args


def test_distributed_attention_arguments():
    class FlashSelfAttention(torch.nn.Module):  # Megatron-DeepSpeed's attributes
        causal, softmax_scale, dropout_p = False, 0.25, 0.0

    da = DistributedAttention(FlashSelfAttention(), None, 2, 0)
    assert (da.causal, da.softmax_scale, da.layout, da.backend) == (False, 0.25, "striped", "auto")
    da = DistributedAttention(None, None, layout="ring", causal=True, backend="math")
    assert (da.causal, da.softmax_scale, da.layout, da.backend) == (True, None, "contiguous", "math")
    with pytest.raises(ValueError, match="unknown layout"):
        DistributedAttention(None, None, layout="ulysses")
    with pytest.raises(ValueError, match="unknown backend"):
        da.configure(backend="cuda")
    q = torch.randn(2, 8, 4, 16)
    with pytest.raises(ValueError, match="batch_dim_idx=2"):
        da(q, q, q, 2)


# ----------------------------------------------- initialize: config errors before any comm


def test_initialize_rejects_bad_config_before_communication():
    import argparse

    import torch.distributed as dist

    from striped_sp.deepspeed import initialize

    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="context_parallel.backend='cuda'"):
        initialize(model=model, config={"sequence_parallel_size": 2, "context_parallel": {"backend": "cuda"}})
    with pytest.raises(ValueError, match="sequence_parallel_size=-1"):
        initialize(model=model, config={"sequence_parallel_size": -1})
    with pytest.raises(ValueError, match="config once"):
        initialize(args=argparse.Namespace(deepspeed_config="ds.json"), model=model, config={})
    with pytest.raises(ValueError, match="needs a config"):
        initialize(model=model)
    assert not dist.is_initialized()  # nothing started


# ------------------------------- Trainer / Accelerate / ZeRO settings: errors before any comm


def _sp2_config(**over):
    return {"zero_optimization": {"stage": 2}, "sequence_parallel_size": 2,
            "context_parallel": {"algo": "striped", "backend": "auto"}, **over}


def test_trainer_arguments_that_conflict_with_sp_are_refused():
    from types import SimpleNamespace

    import torch.distributed as dist

    from striped_sp.deepspeed.trainer import check_training_arguments

    def args(**over):
        kw = dict(deepspeed=_sp2_config(), hf_deepspeed_config=None, world_size=2, average_tokens_across_devices=True,
                  label_smoothing_factor=0.0, group_by_length=False, parallelism_config=None)
        return SimpleNamespace(**{**kw, **over})

    assert check_training_arguments(args()).sequence_parallel_size == 2
    assert not check_training_arguments(args(average_tokens_across_devices=False, deepspeed={})).enabled
    for over, match in [
        (dict(average_tokens_across_devices=False), "average_tokens_across_devices=False"),
        (dict(label_smoothing_factor=0.1), "label_smoothing_factor=0.1"),
        (dict(group_by_length=True), "train_sampling_strategy='group_by_length'"),  # older transformers
        (dict(train_sampling_strategy="group_by_length"), "train_sampling_strategy='group_by_length'"),
        (dict(train_sampling_strategy="batch_rebalance"), "train_sampling_strategy='batch_rebalance'"),
        (dict(parallelism_config=SimpleNamespace(sp_size=2, cp_size=1, tp_size=1)), "parallelism_config.sp_size=2"),
        (dict(deepspeed=None), "TrainingArguments\\(deepspeed=...\\)"),
        (dict(world_size=3), r"sequence_parallel_size=2 must divide the world size \(3\)"),
        (dict(deepspeed=_sp2_config(gradient_predivide_factor=4.0)), "gradient_predivide_factor=4.0"),
    ]:
        with pytest.raises(ValueError, match=match):
            check_training_arguments(args(**over))
    with pytest.raises(ValueError, match="compute_loss_func"):
        check_training_arguments(args(), compute_loss_func=lambda *a, **k: 0)
    assert not dist.is_initialized()


def test_enable_accelerate_refuses_conflicting_settings_before_communication():
    from types import SimpleNamespace

    import torch.distributed as dist

    from striped_sp.deepspeed import enable_accelerate

    def accelerator(cfg, **over):
        kw = dict(state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=cfg)), num_processes=2,
                  split_batches=False, parallelism_config=None)
        return SimpleNamespace(**{**kw, **over})

    for acc, match in [
        (accelerator(_sp2_config(), split_batches=True), "split_batches=True"),
        (accelerator(_sp2_config(), parallelism_config=SimpleNamespace(sp_size=2)), "parallelism_config.sp_size=2"),
        (accelerator(_sp2_config(context_parallel={"algo": "ulysses"})), "context_parallel.algo='ulysses'"),
        (accelerator(_sp2_config(), num_processes=3), r"must divide the world size \(3\)"),
        (SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=None)), "DeepSpeed plugin"),
    ]:
        with pytest.raises(ValueError, match=match):
            enable_accelerate(acc)
    plain = accelerator({"zero_optimization": {"stage": 1}, "sequence_parallel_size": 1,
                         "context_parallel": {"backend": "auto"}}, num_processes=1)
    assert not enable_accelerate(plain).enabled  # SP 1: nothing to patch
    assert plain.state.deepspeed_plugin.deepspeed_config["context_parallel"] == {}  # no "auto" for accelerate
    assert not dist.is_initialized()


def test_zero_settings_that_conflict_with_sp_are_refused():
    from striped_sp.deepspeed.zero import check_sequence_parallel_settings

    check_sequence_parallel_settings(_sp2_config(gradient_predivide_factor=1.0))
    for over, match in [({"gradient_predivide_factor": 2}, "gradient_predivide_factor=2"),
                        ({"tensor_parallel": {"autotp_size": 2}}, "autotp_size=2"),
                        ({"zero_optimization": {"stage": 3, "mics_shard_size": 4}}, "mics_shard_size=4")]:
        with pytest.raises(ValueError, match=match):
            check_sequence_parallel_settings(_sp2_config(**over))


def test_config_order_mirror_makes_zigzags_order_a_striped_layout():
    """``order`` (issue 57): "mirror" deals stripes to ranks 0..N-1 then N-1..0; refused by name without an int
    stripe size or with another algo; "round" is the default's own order."""
    mirror = parse_config({"context_parallel": {"stripe_size": 4, "order": "mirror"}})
    assert mirror.layout == "striped:stripe=4,order=mirror"
    assert torch.equal(positions(32, 2, 0, mirror.layout), torch.tensor([0, 1, 2, 3, 12, 13, 14, 15,
                                                                                    16, 17, 18, 19, 28, 29, 30, 31]))
    assert parse_config({"context_parallel": {"order": "round"}}).layout == "striped"
    assert parse_config({"context_parallel": {"stripe_size": 1, "order": "round"}}).layout == "striped:stripe=1"
    for section, words in (({"order": "snake"}, "context_parallel.order='snake' must be 'round'"),
                           ({"order": "mirror"}, "context_parallel.order='mirror' with context_parallel.stripe_size=None"),
                           ({"stripe_size": "doc", "order": "mirror"}, "needs an int stripe size"),
                           ({"algo": "zigzag", "order": "mirror"}, "applies to context_parallel.algo='striped' only")):
        with pytest.raises(ValueError, match=re.escape(words)):
            parse_config({"context_parallel": section})


def test_config_stripe_size_auto_searches_stripes_and_placement():
    def layout(**section):
        return parse_config({"sequence_parallel_size": 2, "context_parallel": section}, world_size=2).layout

    assert layout(stripe_size="auto") == "striped:stripe=auto"  # placement searched too
    assert layout(stripe_size="auto", doc_placement="split") == "striped:stripe=auto,place=split"
    assert layout(stripe_size="auto", doc_placement=256) == "striped:stripe=auto,place=256"
    with pytest.raises(ValueError, match="stripe_size='autoo'"):
        layout(stripe_size="autoo")
    with pytest.raises(ValueError, match="applies to context_parallel.algo='striped' only"):
        layout(algo="zigzag", stripe_size="auto")


def test_accelerate_gets_our_auto_choices_back_in_initialize(monkeypatch):
    """accelerate must not see "auto" values in the section, but our initialize must: a dropped
    stripe_size / doc_placement "auto" would shard the data with one layout and attend with another."""
    import importlib

    import deepspeed

    from striped_sp.deepspeed import accelerate as acc

    from striped_sp.deepspeed.config import ContextParallelSettings

    seen, hints = {}, []
    module = importlib.import_module("striped_sp.deepspeed.initialize")

    def initialize(**kw):  # what ours hands on, and the window hint it pins for the attention
        seen.update(kw["config"])
        hints.append(module.LOADER_WINDOW_HINT.get())

    monkeypatch.setattr(module, "initialize", initialize)
    config = {"sequence_parallel_size": 2, "train_batch_size": 8,
              "context_parallel": {"backend": "auto", "stripe_size": "auto", "doc_placement": "auto", "ulysses_size": 1}}
    autos = acc._drop_auto_values(config)
    assert config["context_parallel"] == {"ulysses_size": 1}
    loaders = ContextParallelSettings(sequence_parallel_size=2, window=4096, global_every=6)  # the loaders' layout
    with acc._deepspeed_initialize_is_ours(autos, loaders):
        deepspeed.initialize(config=config)
    assert seen["context_parallel"] == {"ulysses_size": 1, "backend": "auto", "stripe_size": "auto", "doc_placement": "auto"}
    assert parse_config(seen, world_size=2).layout == "striped:stripe=auto"
    assert hints == [(4096, 6)] and module.LOADER_WINDOW_HINT.get() is None  # pinned for that call only


def test_config_calibrate_is_a_strict_bool():
    base = {"sequence_parallel_size": 2}
    assert not parse_config({**base, "context_parallel": {}}, world_size=2).calibrate
    assert parse_config({**base, "context_parallel": {"calibrate": True}}, world_size=2).calibrate
    with pytest.raises(ValueError, match="context_parallel.calibrate"):
        parse_config({**base, "context_parallel": {"calibrate": "yes"}}, world_size=2)
