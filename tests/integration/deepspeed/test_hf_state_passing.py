"""State passing on the Hugging Face path (issue 55): hybrids' gated delta net, Mamba2 and short
convolutions run on contiguous chunks joined by their states, exact against the plain model at SP=1.

Each family's own classes at a tiny shape (tests/support/token_mixing.py), weights moved off their
initialisation, on 2 and 4 gloo ranks: ``$STRIPED_SP_MIXER_MODE=state`` runs state passing where the
head all-to-all could run too, and heads that do not divide by N (6 value heads on 4 ranks, 2 on 4,
2 Mamba2 heads on 4) take state passing by themselves, never the gather.  The reference is a copy of
the model taken before anything of ours touches it, run at SP=1 on the whole batch with transformers'
own attention; loss to 1e-5 and every gradient summed over the group to 1e-4 (hybrid_cases.compare)."""

import copy
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

pytest.importorskip("transformers")

from case_tests import cases_test  # noqa: E402
from hybrid_cases import batch as _batch, compare as _compare, exchanges as _exchanges  # noqa: E402
from support.token_mixing import HYBRID_SHAPES as SHAPES  # noqa: E402

DTYPES = {"granitemoehybrid": torch.float32}


def _summed(calls):
    """Counts the state-passing collectives while a case runs: re-layouts and summary/halo gathers."""
    from striped_sp.engine import state_passing

    real = state_passing._exchange

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    return real, counted


def _delta_rule_f64(query, key, value, g, beta, initial_state=None, output_final_state=False,
                    use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers' ``torch_chunk_gated_delta_rule`` as its recurrent form in float64 (transformers' own
    computes in float32 whatever the model's dtype: a decay's gradient of ~1e-5 then differs by float32
    rounding between two exact orders of the sums)."""
    assert initial_state is None and kwargs.get("cu_seqlens") is None
    q, k, v, g, beta = (t.double() for t in (query, key, value, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = (t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    ratio = v.size(2) // k.size(2)
    q, k = (t.repeat_interleave(ratio, dim=2) for t in (q, k))
    q = q * q.size(-1) ** -0.5
    state = q.new_zeros(q.size(0), q.size(2), q.size(3), v.size(3))
    outs = []
    for t in range(q.size(1)):
        state = state * g[:, t].exp()[..., None, None]
        delta = (v[:, t] - (state * k[:, t, :, :, None]).sum(-2)) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, t, :, :, None]).sum(-2))
    out = torch.stack(outs, 1).to(value.dtype)
    return out, (state if output_final_state else None)


def _case(model_type, layout="striped", mode="state", overrides=None, expect="state passing", precise=False):
    import importlib

    modeling = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    kernel = getattr(modeling, "torch_chunk_gated_delta_rule", None)
    if precise:
        modeling.torch_chunk_gated_delta_rule = _delta_rule_f64
    try:
        _run(model_type, layout, mode, overrides, expect)
    finally:
        if precise:
            modeling.torch_chunk_gated_delta_rule = kernel


def _run(model_type, layout, mode, overrides, expect):
    from striped_sp.deepspeed import enable_hf_attention, shard_batch
    from striped_sp.deepspeed.hybrid import MODE_ENV, mixer_modes, mixer_summary
    from striped_sp.engine import state_passing
    from support.token_mixing import tiny_causal_lm

    n, rank = dist.get_world_size(), dist.get_rank()
    model = tiny_causal_lm(model_type, **{**SHAPES[model_type], **(overrides or {})})[0]
    model = model.to(DTYPES.get(model_type, torch.float64)).train()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    full = _batch()
    ref_out = ref(**full, use_cache=False)
    ref_out.loss.backward()
    old = os.environ.get(MODE_ENV)
    if mode is not None:
        os.environ[MODE_ENV] = mode
    calls = [0]
    real, counted = _summed(calls)
    state_passing._exchange = counted
    try:
        enable_hf_attention(model, None, layout)
        seq = full["input_ids"].size(1)
        modes = mixer_modes(model, n, seq)
        assert modes and all(m == expect for _, m, _ in modes), modes
        assert f"{expect} (" in mixer_summary(model, n, seq), mixer_summary(model, n, seq)
        with _exchanges() as head_calls:
            out = model(**shard_batch(full, n, rank, layout), use_cache=False)
            out.loss.backward()
    finally:
        state_passing._exchange = real
        os.environ.pop(MODE_ENV, None) if old is None else os.environ.__setitem__(MODE_ENV, old)
    _compare(model, ref, out.loss, ref_out.loss)
    if expect == "split":  # the head all-to-all each way, forward and backward; no re-layout
        assert head_calls == [4 * len(modes)] and calls == [0], (head_calls, calls, len(modes))
        return
    assert head_calls == [0], head_calls  # no head all-to-all: one re-layout each way, forward and backward
    assert calls[0] == 4 * len(modes), (calls, len(modes))


def _case_packed(model_type):
    """A packed row (DataCollatorWithFlattening: position_ids restart per document, cu_seq_lens_q/k):
    state passing sees the documents where the model's kernels do, and refuses what SP=1 refuses."""
    import re

    from striped_sp.deepspeed import enable_hf_attention, shard_batch
    from striped_sp.deepspeed.hybrid import MODE_ENV
    from striped_sp.engine import state_passing
    from support.token_mixing import tiny_causal_lm
    from transformers import DataCollatorWithFlattening

    n, rank = dist.get_world_size(), dist.get_rank()
    model = tiny_causal_lm(model_type, **SHAPES[model_type])[0].to(torch.float64).train()
    ref = copy.deepcopy(model)
    ref.set_attn_implementation("eager")
    g = torch.Generator().manual_seed(8)
    full = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(
        [{"input_ids": torch.randint(3, 100, (k,), generator=g).tolist()} for k in (5, 9, 3, 7, 8)])
    os.environ[MODE_ENV] = "state"
    calls = [0]
    real, counted = _summed(calls)
    try:
        enable_hf_attention(model, None, "striped")
        batch = shard_batch(full, n, rank, "striped")
        try:
            ref_out = ref(**full, use_cache=False)
        except ValueError as err:  # refused at SP=1: so under SP, before the mixer's first message
            state_passing._exchange = counted
            with pytest.raises(ValueError, match=re.escape(str(err))):
                model(**batch, use_cache=False)
            assert calls == [0], calls
            return
        ref_out.loss.backward()
        out = model(**batch, use_cache=False)
        out.loss.backward()
    finally:
        state_passing._exchange = real
        os.environ.pop(MODE_ENV)
    _compare(model, ref, out.loss, ref_out.loss)


def _case_by_cost(model_type):
    """``auto`` runs the cost model's choice: figures under which state passing is the cheaper form at
    this row's length put every mixer on it (exact as above); the shipped ones keep the split on so
    short a row (test_hf_hybrid_families)."""
    from striped_sp.plan import mixer_cost

    kind = {"qwen3_next": "gated delta net", "falcon_h1": "Mamba2"}[model_type]
    shipped = mixer_cost.FITTED.get(kind)
    mixer_cost.FITTED[kind] = {"split": (1.0, 0.0), "state": (0.5, 0.0), "gathered": (9.0, 0.0)}
    try:
        _run(model_type, "striped", None, None, "state passing")
    finally:
        mixer_cost.FITTED.pop(kind)
        if shipped is not None:
            mixer_cost.FITTED[kind] = shipped


def _case_short_chunks():
    """Chunks shorter than the convolution's halo (4 tokens on 4 ranks, window 3): refused on every rank
    before the first message."""
    from striped_sp.deepspeed import enable_hf_attention, shard_batch
    from support.token_mixing import tiny_causal_lm

    n, rank = dist.get_world_size(), dist.get_rank()
    model = tiny_causal_lm("lfm2", **SHAPES["lfm2"])[0].to(torch.float64)
    os.environ["STRIPED_SP_MIXER_MODE"] = "state"
    try:
        enable_hf_attention(model, None, "striped")
        with pytest.raises(ValueError, match=r"state passing needs chunks of at least 2 tokens .* 4 tokens on 4 "
                                             r"ranks give 1"):
            model(**shard_batch(_batch(seq=4), n, rank, "striped"), use_cache=False)
    finally:
        os.environ.pop("STRIPED_SP_MIXER_MODE")


def _case_bad_mode():
    from striped_sp.deepspeed.hybrid import MODE_ENV, mixer_mode

    os.environ[MODE_ENV] = "fast"
    try:
        with pytest.raises(ValueError, match=r"STRIPED_SP_MIXER_MODE='fast': must be one of auto, state, split"):
            mixer_mode()
    finally:
        os.environ.pop(MODE_ENV)


FAMILIES = ("qwen3_next", "falcon_h1", "granitemoehybrid", "lfm2")
CASES2 = [(f"{t}_striped", _case, (t,)) for t in FAMILIES]
CASES2 += [(f"qwen3_next_{lay}", _case, ("qwen3_next", lay)) for lay in ("zigzag", "contiguous")]
CASES2 += [(f"falcon_h1_{lay}", _case, ("falcon_h1", lay)) for lay in ("zigzag", "contiguous")]
CASES2 += [("bad_mode", _case_bad_mode, ())]
CASES2 += [(f"{t}_packed", _case_packed, (t,)) for t in ("qwen3_next", "falcon_h1", "lfm2")]
CASES2 += [(f"{t}_auto_by_cost", _case_by_cost, (t,)) for t in ("qwen3_next", "falcon_h1")]
CASES4 = [(f"{t}_striped", _case, (t,)) for t in ("qwen3_next", "falcon_h1", "lfm2")]
CASES4 += [("qwen3_next_zigzag", _case, ("qwen3_next", "zigzag")), ("short_chunks", _case_short_chunks, ())]
# heads that do not divide by N: state passing by itself (auto), never the gather
CASES4 += [("qwen3_next_6_heads_auto", _case, ("qwen3_next", "striped", None,
                                                dict(linear_num_value_heads=6, linear_num_key_heads=2))),
           ("qwen3_next_2_heads_auto", _case, ("qwen3_next", "striped", None,
                                                dict(linear_num_value_heads=2, linear_num_key_heads=1),
                                                "state passing", True)),
           ("falcon_h1_2_heads_auto", _case, ("falcon_h1", "striped", None,
                                              dict(mamba_n_heads=2, mamba_d_head=32)))]

# N = 8 with 4 key heads (8 value heads): both forms, exact
EIGHT = dict(linear_num_value_heads=8, linear_num_key_heads=4)
CASES8 = [("qwen3_next_4_key_heads_state", _case, ("qwen3_next", "striped", "state", EIGHT)),
          ("qwen3_next_4_key_heads_split", _case, ("qwen3_next", "striped", "split", EIGHT, "split"))]


test_state_passing_on_2_ranks = cases_test(2, CASES2, timeout_s=600)
test_state_passing_on_4_ranks = cases_test(4, CASES4, timeout_s=600)
test_state_passing_on_8_ranks = pytest.mark.release(cases_test(8, CASES8, timeout_s=900))
