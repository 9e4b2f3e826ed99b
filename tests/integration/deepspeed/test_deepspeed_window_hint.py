"""The striped default takes a transformers model's sliding window as its layout hint (issue 36), on
2 gloo ranks: ``initialize`` with a Mistral-style model (every layer windowed) and a Qwen2-style one
(one global layer in three) and ``training_data`` runs ``"striped:window=W[,global_every=K]"``; its
loader deals the stripes the cost model picks for the hint (128 = S / N here, issue 57; positions
written out by hand); the loss and gradients equal the plain
model's on the full rows (transformers' own sliding-window mask, no context parallelism).  Without
``training_data`` (the user shards in ``"striped"``) there is no hint."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch
import torch.distributed as dist

from dist_helper import run_cases, check_case
from reference import rel_err
from test_deepspeed_packed import _setup  # DeepSpeed's comm on the gloo ranks, its shm op never built

pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

WORLD, SEQ, WINDOW = 2, 256, 40
STRIPE = 128  # the cost model's stripes for both hints on one document of 256 tokens (plan/window_choice.py)


def _model(kind):
    import transformers as tf

    torch.manual_seed(3)
    common = dict(vocab_size=61, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=2 * SEQ, attention_dropout=0.0, tie_word_embeddings=False,
                  sliding_window=WINDOW)
    if kind == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, num_hidden_layers=2))
    else:  # layer 0 global, layers 1 and 2 windowed
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, num_hidden_layers=3, use_sliding_window=True,
                                                   max_window_layers=1))
    model.set_attn_implementation("sdpa")
    return model


class _Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        ids = torch.randint(0, 61, (SEQ,), generator=torch.Generator().manual_seed(10 + i))
        return {"input_ids": ids, "labels": ids.clone()}


def _case(kind, layout):
    from striped_sp.deepspeed import initialize
    from striped_sp.plan.layouts import get_layout

    ref = _model(kind)
    rows = [_Rows()[i] for i in range(2)]
    full = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
    ref_loss = ref(**full).loss
    ref_loss.backward()
    model = _model(kind)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 0}, "sequence_parallel_size": WORLD, "context_parallel": {}}
    engine, _, loader, _ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=config, training_data=_Rows())
    assert engine.context_parallel.layout == layout, engine.context_parallel.layout
    rank = dist.get_rank(engine.context_parallel_group)
    batch = next(iter(loader))
    assert get_layout(layout).row_stripe(SEQ, WORLD) == STRIPE
    by_hand = [p for p in range(SEQ) if (p // STRIPE) % WORLD == rank]
    assert batch["position_ids"][0].tolist() == by_hand
    loss = engine(**batch).loss
    engine.backward(loss)
    assert rel_err(loss.detach(), ref_loss.detach()) < 1e-5, (loss.item(), ref_loss.item())
    for (name, p), (_, q) in zip(engine.module.named_parameters(), ref.named_parameters()):
        assert rel_err(p.grad, q.grad) < 1e-5, name


def _case_user_shards():
    """Without training_data the user shards (shard_batch's "striped"): no hint, the layouts agree."""
    from striped_sp import positions
    from striped_sp.deepspeed import initialize, shard_batch

    model = _model("mistral")
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "zero_optimization": {"stage": 0}, "sequence_parallel_size": WORLD, "context_parallel": {}}
    engine, _, _, _ = initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
    assert engine.context_parallel.layout == "striped"
    rank = dist.get_rank(engine.context_parallel_group)
    rows = [_Rows()[i] for i in range(2)]
    batch = shard_batch({k: torch.stack([r[k] for r in rows]) for k in rows[0]}, WORLD, rank, "striped")
    assert torch.equal(batch["position_ids"][0], positions(SEQ, WORLD, rank))
    assert torch.isfinite(engine(**batch).loss)


CASES = [("setup", _setup, ()), ("user_shards", _case_user_shards, ()),
         ("mistral", _case, ("mistral", f"striped:window={WINDOW}")),
         ("qwen2_mixed", _case, ("qwen2", f"striped:window={WINDOW},global_every=3"))]


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES, timeout_s=300)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_window_hint_case(results, name):
    check_case(results, name)
