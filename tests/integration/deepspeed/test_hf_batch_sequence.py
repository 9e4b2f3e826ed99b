"""Batches in sequence on the Hugging Face path: each batch's documents are its own
(striped_sp/deepspeed/hf.py reads a batch's ``cu_seq_lens`` afresh in the model's forward pre-hook).

A hybrid's mixers (:mod:`striped_sp.deepspeed.hybrid`) order the gathered row by the documents of
the batch the model runs now.  A dense batch after a packed one must not keep the packed batch's
bounds: the mixer would put the dense row's tokens in the packed row's placement (which differs
from the dense one where the layout places documents) and run silently wrong.  One model trained
on a packed batch, a dense one of the same length, a packed one again and a dense one again, at
SP=2, each batch against a copy of the plain model at SP=1 with transformers' own attention (loss
within 1e-5 relative, every gradient within 1e-4 after summing over the group as DeepSpeed does),
float32: a hybrid (LFM2's short convolutions) under the default ``striped`` and per-document
stripes, and a plain attention-only Llama the same way."""

import copy
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

pytest.importorskip("transformers")

from case_tests import cases_test  # noqa: E402
from reference import rel_err  # noqa: E402

SEQ = 32
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4
#: two packed rows whose documents move tokens under the layouts below (checked in the case)
PACKED = ((5, 9, 3, 7, 8), (11, 2, 19))
SHAPES = {"lfm2": dict(num_hidden_layers=4, layer_types=["conv", "full_attention", "conv", "full_attention"]),
          "llama": dict(num_hidden_layers=2)}


def _packed(lengths, seed):
    """A packed row as DataCollatorWithFlattening makes it (position_ids restart per document,
    cu_seq_lens_q/k), SEQ tokens."""
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(3, 100, (n,), generator=g).tolist()} for n in lengths]
    return DataCollatorWithFlattening(return_flash_attn_kwargs=True)(features)


def _dense(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (1, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _moves_tokens(bounds, n, layout):
    import striped_sp

    return any(not torch.equal(striped_sp.positions(SEQ, n, r, layout, cu_seqlens=bounds),
                               striped_sp.positions(SEQ, n, r, layout)) for r in range(n))


def check_batches_in_sequence(model_type, layout):
    from striped_sp.deepspeed import enable_hf_attention, shard_batch
    from support.token_mixing import tiny_causal_lm

    n, rank = dist.get_world_size(), dist.get_rank()
    model = tiny_causal_lm(model_type, **SHAPES[model_type])[0].to(torch.float32).train()
    ref = copy.deepcopy(model)  # before anything of ours touches the model
    ref.set_attn_implementation("eager")
    enable_hf_attention(model, None, layout)
    batches = [("packed", _packed(PACKED[0], 8)), ("dense", _dense(9)), ("packed again", _packed(PACKED[1], 10)),
               ("dense again", _dense(11))]
    for name, full in batches:
        if "cu_seq_lens_q" in full:
            assert _moves_tokens(full["cu_seq_lens_q"].tolist(), n, layout), "a row whose documents move no token"
        model.zero_grad(set_to_none=True)
        ref.zero_grad(set_to_none=True)
        ref_out = ref(**full, use_cache=False)
        ref_out.loss.backward()
        out = model(**shard_batch(full, n, rank, layout), use_cache=False)
        out.loss.backward()
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)  # each rank's loss is its share of the global mean
        assert rel_err(loss, ref_out.loss.detach()) < LOSS_TOL, (name, loss.item(), ref_out.loss.item())
        ref_grads, grads = _grads(ref), _grads(model)
        assert ref_grads.keys() == grads.keys(), (name, set(ref_grads) ^ set(grads))
        worst = []
        for key, g in grads.items():
            dist.all_reduce(g)  # DeepSpeed sums gradients over the SP group
            err = rel_err(g, ref_grads[key])
            if err >= GRAD_TOL:
                worst.append(f"{key}: {err:.2e}")
        assert not worst, (name, worst)


CASES = [(f"{model_type}-{layout}", check_batches_in_sequence, (model_type, layout))
         for model_type, layout in (("lfm2", "striped"), ("lfm2", "striped:stripe=doc"), ("llama", "striped"))]
test_batches_in_sequence = cases_test(2, CASES, timeout_s=600)
