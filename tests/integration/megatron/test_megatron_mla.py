"""Multi-latent attention (megatron-core's ``MLASelfAttention``) at CP=2 against CP=1, on 2 gloo ranks.

A tiny MLA GPT (q/k head dim ``qk_head_dim + qk_pos_emb_head_dim`` = 12, v head dim 6 or 20) with
our core attention at CP=2 in the striped and zigzag layouts, against the same model at CP=1 whose
core attention is the independent float64 ``megatron_reference.ReferenceCoreAttention`` on the
whole sequence: loss and every gradient, dense rows and packed THD rows (``cu_seqlens``, padded
for zigzag).  Megatron applies RoPE to the positional part of q/k inside MLA; under CP its rotary
rows must be the layout's positions (``install()``), which only an exact comparison shows.  The
kernels: the CPU flash op (v zero-padded to q/k's head dim, or q/k to v's) and the math kernel
(v's head dim natively).  One spawn runs every case.
"""

import random

import pytest
import torch
import torch.distributed as dist

from dist_helper import run_cases
from megatron_reference import compare, document_mask, use_reference_attention

pytest.importorskip("megatron.core")

SEED = random.randrange(2**31)
SEQ = 28  # a multiple of 2 * CP, not a power of two
VOCAB = 48
_GROUPS = {}


def _setup():
    """Megatron's parallel_state with CP=2; this rank's CP groups by size (1 and 2)."""
    if _GROUPS:
        return _GROUPS
    import warnings

    warnings.filterwarnings("ignore")
    from megatron.core import parallel_state
    from megatron.core.transformer import multi_latent_attention

    from striped_sp.megatron.toy import single_rank_group

    # megatron-core 0.16.1 reads HAVE_TE as "linear_proj may be a TELinear" and calls isinstance
    # with TELinear, which is no type without Transformer Engine: the local spec has none.
    multi_latent_attention.HAVE_TE = False
    parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size())
    _GROUPS[1] = single_rank_group()
    _GROUPS[2] = parallel_state.get_context_parallel_group()
    return _GROUPS


def mla_gpt(cp_group, seed, rope_type="rope", q_lora_rank=None, v_head_dim=6, **config_kw):
    """A 2-layer MLA GPTModel (float32, no dropout) on ``cp_group``; the same weights for a seed;
    ``config_kw``: more ``MLATransformerConfig`` fields."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from striped_sp.megatron.toy import pg_collection

    config = MLATransformerConfig(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
        q_lora_rank=q_lora_rank, kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4,
        v_head_dim=v_head_dim, rope_type=rope_type, original_max_position_embeddings=16,
        context_parallel_size=cp_group.size(), attention_dropout=0.0, hidden_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32, normalization="RMSNorm", **config_kw,
    )
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")
    torch.manual_seed(seed)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=64, position_embedding_type="none",
                    pg_collection=pg_collection(cp_group))


def _models(algo, backend, seed, scale_error=None, **mla):
    import striped_sp.megatron as sm

    env = _setup()
    sm.install(algo, backend)
    ref = mla_gpt(env[1], seed, **mla)
    use_reference_attention(ref, ref.config)
    model = mla_gpt(env[2], seed, **mla)
    ours = [m for m in model.modules() if isinstance(m, sm.ContextParallelAttention)]
    dv = mla.get("v_head_dim", 6)
    assert len(ours) == 2 and all((m.hidden_size_per_attention_head, m.value_head_dim) == (12, dv) for m in ours)
    if mla.get("cp_comm_type") == "a2a":  # Ulysses over the CP group really runs
        assert all(m.ulysses_groups is not None for m in ours)
    if scale_error is not None:  # a deliberate adapter bug: the comparison must catch it
        for m in ours:
            m.softmax_scale *= 1 + scale_error
    return ref, model, env[2]


def _batch(seed, batch=2, seq=SEQ):
    gen = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, VOCAB, (batch, seq), generator=gen),
            "labels": torch.randint(0, VOCAB, (batch, seq), generator=gen),
            "loss_mask": (torch.rand(batch, seq, generator=gen) > 0.2).float(),
            "position_ids": torch.arange(seq).expand(batch, seq).contiguous()}


def check_dense(algo, backend, seed, scale_error=None, **mla):
    import striped_sp.megatron as sm

    ref, model, group = _models(algo, backend, seed, scale_error, **mla)
    b = _batch(seed + 1)
    ref_loss = (ref(b["tokens"], b["position_ids"], None, labels=b["labels"]) * b["loss_mask"]).sum()
    ref_loss.backward()
    local = sm.get_batch_on_this_cp_rank(b, algo, cp_group=group)
    loss = (model(local["tokens"], local["position_ids"], None, labels=local["labels"]) * local["loss_mask"]).sum()
    loss.backward()
    compare(model, ref, loss, ref_loss, group, seed)


def check_packed(algo, backend, padded, seed, **mla):
    """One packed THD row (documents of uneven lengths, two shorter than CP); the reference runs the
    row as one sequence with Megatron's document mask (RoPE is relative, so a document's rotary
    rows starting at its own first token or at the row's give the same scores)."""
    import striped_sp.megatron as sm
    from test_megatron_packed import thd_row

    ref, model, group = _models(algo, backend, seed, **mla)
    batch, cu, cu_padded, max_seqlen, bounds = thd_row(group.size(), padded, seed + 1)
    total = batch["tokens"].size(1)
    out = ref(batch["tokens"], batch["position_ids"], document_mask(bounds, total), labels=batch["labels"])
    ref_loss = (out * batch["loss_mask"]).sum()
    ref_loss.backward()
    local, params = sm.get_thd_batch_on_this_cp_rank(dict(batch), cu, cu_padded, max_seqlen, algo=algo,
                                                     cp_group=group)
    loss = (model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                  packed_seq_params=params) * local["loss_mask"]).sum()
    loss.backward()
    compare(model, ref, loss, ref_loss, group, seed)


def check_adapter_bug_is_caught(seed):
    with pytest.raises(AssertionError, match=str(seed)):  # compare's message, not a setup assert
        check_dense("striped", "auto", seed, scale_error=0.01)


CASES = [
    # dense rows: the CPU flash op gets v padded (6 -> 12) or q/k padded (12 -> 20); math takes v as is
    ("dense-striped-rope", check_dense, ("striped", "auto", SEED)),
    ("dense-zigzag-yarn-qlora", check_dense, ("zigzag", "auto", SEED + 1)),
    ("dense-striped-math", check_dense, ("striped", "math", SEED + 2)),
    ("dense-zigzag-v20", check_dense, ("zigzag", "auto", SEED + 3)),
    ("dense-striped-ulysses", check_dense, ("striped", "auto", SEED + 8)),  # --cp-comm-type a2a
    # packed THD rows
    ("packed-striped-rope", check_packed, ("striped", "auto", False, SEED + 4)),
    ("packed-zigzag-yarn-padded", check_packed, ("zigzag", "auto", True, SEED + 5)),
    ("packed-striped-math-yarn", check_packed, ("striped", "math", False, SEED + 6)),
    ("adapter-bug-is-caught", check_adapter_bug_is_caught, (SEED + 7,)),
]
_MLA = {"dense-zigzag-yarn-qlora": dict(rope_type="yarn", q_lora_rank=16), "dense-zigzag-v20": dict(v_head_dim=20),
        "dense-striped-ulysses": dict(cp_comm_type="a2a"),
        "packed-zigzag-yarn-padded": dict(rope_type="yarn"), "packed-striped-math-yarn": dict(rope_type="yarn")}
_results = {}


def _run(name, fn, args):
    fn(*args, **_MLA.get(name, {}))


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_mla_cp2_equals_cp1(name):
    if not _results:
        _results.update(run_cases(2, [(n, _run, (n, fn, args)) for n, fn, args in CASES]))
    assert _results[name] is None, _results[name]
