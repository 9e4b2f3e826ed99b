"""gpt-oss under context parallelism: its attention sinks (``s_aux``), its alternating 128-token
windows and global layers, on dense and packed rows, equal the plain model (issue 47).

transformers' own ``GptOssForCausalLM`` at a tiny shape (window 8 so that windows bite at 32 tokens),
sinks drawn away from zero (a sink of 0 would still be a logit, but a dropped d sinks would hide
behind small ones), on 2 and 4 gloo ranks, against a copy of the model taken before anything of ours
touches it, run at SP=1 with transformers' eager attention (which adds the sink as a softmax column;
packed rows document by document).
Loss to 1e-5, every gradient (the sinks' included) to 1e-4."""

import copy
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

pytest.importorskip("transformers")

from dist_helper import check_case, run_cases  # noqa: E402
from test_hf_hybrids import _compare, _flattened, SEQ  # noqa: E402

GPT_OSS = dict(num_hidden_layers=4, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
               num_local_experts=4, num_experts_per_tok=2, head_dim=16, use_cache=False)


def _model(**overrides):
    from support.token_mixing import tiny_causal_lm

    model, why = tiny_causal_lm("gpt_oss", **{**GPT_OSS, **overrides})
    assert model is not None, why
    sinks = [m.sinks for m in model.modules() if isinstance(getattr(m, "sinks", None), torch.nn.Parameter)]
    assert len(sinks) == GPT_OSS["num_hidden_layers"], len(sinks)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for s in sinks:
            s.copy_(torch.randn(s.shape, generator=g) * 2)
    return model.train()


def _dense(b=2):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 100, (b, SEQ), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def _per_document_loss(model, full):
    """The packed row's mean next-token loss with every document run on its own (transformers'
    eager gpt-oss builds its masks without position_ids, so its packed row would attend across
    documents; flash-attention at SP=1 and the ring do not)."""
    ids, pos = full["input_ids"][0], full["position_ids"][0].tolist()
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    total = sum(torch.nn.functional.cross_entropy(model(input_ids=ids[None, a:b]).logits[0, :-1], ids[a + 1:b],
                                                  reduction="sum") for a, b in zip(starts, starts[1:]))
    return total / sum(b - a - 1 for a, b in zip(starts, starts[1:]))


def _case(kind, layout):
    from striped_sp.deepspeed import enable_hf_attention, shard_batch

    n, rank = dist.get_world_size(), dist.get_rank()
    model = _model()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    full = _dense() if kind == "dense" else _flattened()
    ref_loss = ref(**full).loss if kind == "dense" else _per_document_loss(ref, full)
    ref_loss.backward()
    enable_hf_attention(model, None, layout)
    out = model(**shard_batch(full, n, rank, layout))
    out.loss.backward()
    assert any(".sinks" in name for name, p in model.named_parameters() if p.grad is not None)
    _compare(model, ref, out.loss, ref_loss)


CASES2 = [(f"{kind}_{lay}", _case, (kind, lay)) for kind in ("dense", "packed")
          for lay in ("striped", "zigzag", "contiguous")]
CASES4 = [("dense_striped", _case, ("dense", "striped")), ("packed_striped", _case, ("packed", "striped"))]


@pytest.fixture(scope="module")
def results2():
    return run_cases(2, CASES2, timeout_s=600)


@pytest.fixture(scope="module")
def results4():
    return run_cases(4, CASES4, timeout_s=600)


@pytest.mark.parametrize("name", [c[0] for c in CASES2])
def test_gpt_oss_on_2_ranks(results2, name):
    check_case(results2, name)


@pytest.mark.parametrize("name", [c[0] for c in CASES4])
def test_gpt_oss_on_4_ranks(results4, name):
    check_case(results4, name)
