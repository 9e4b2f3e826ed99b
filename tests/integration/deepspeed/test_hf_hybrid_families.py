"""The hybrid families of transformers 5.24 beyond test_hf_hybrids.py's (issue 54 item 4): each one's
mixers split over the group, exact against the plain model at SP=1, or the model is refused by name.

Split and exact on 2 gloo ranks (striped), one all-to-all each way per mixer layer forward and
backward: Bamba (Mamba2, one B/C group shared by every rank), NemotronH (Mamba2, two groups: one per
rank), Zamba2 (Mamba2; its hybrid layers hold the mixer one level down), OLMo hybrid (gated delta net
with separate projections, beta doubled), LFM2-MoE (short convolution).  The pure state-space models
(Mamba, Mamba2, FalconMamba: no attention at all) are refused by name before any collective.
Weights are moved off their initialisation (:func:`support.token_mixing.tiny_causal_lm`)."""

import copy
import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

pytest.importorskip("transformers")

from dist_helper import check_case, run_cases  # noqa: E402
from hybrid_cases import batch, compare, exchanges, mixer_count  # noqa: E402

#: model type -> (tiny config overrides, dtype, the mixer kind the setup line must name)
FAMILIES = {
    "bamba": (dict(num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=32, mamba_d_state=8,
                   mamba_chunk_size=8), torch.float64, "Mamba2"),
    "nemotron_h": (dict(num_hidden_layers=2, layers_block_type=["mamba", "attention"], mamba_num_heads=4,
                        mamba_head_dim=16, n_groups=2, ssm_state_size=8, chunk_size=8), torch.float64, "Mamba2"),
    "zamba2": (dict(num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], mamba_headdim=16, n_mamba_heads=8,
                    mamba_d_state=8, mamba_ngroups=1, chunk_size=8), torch.float64, "Mamba2"),
    "olmo_hybrid": (dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]), torch.float64,
                    "gated delta net"),
    "lfm2_moe": (dict(num_hidden_layers=2, layer_types=["conv", "full_attention"]), torch.float32,
                 "short convolution"),
}
#: attention-free models: refused by name (their token mixing is all state-space scans)
PURE_SSM = {"mamba": dict(num_hidden_layers=2), "falcon_mamba": dict(num_hidden_layers=2),
            "mamba2": dict(num_hidden_layers=2, num_heads=8, head_dim=16, expand=2, n_groups=1)}


def _model(model_type, overrides):
    from support.token_mixing import tiny_causal_lm

    model, why = tiny_causal_lm(model_type, **overrides)
    assert model is not None, (model_type, why)
    return model


def _case_family(model_type):
    from striped_sp.deepspeed import enable_hf_attention, shard_batch
    from striped_sp.deepspeed.hybrid import mixer_summary

    overrides, dtype, kind = FAMILIES[model_type]
    n, rank = dist.get_world_size(), dist.get_rank()
    model = _model(model_type, overrides).to(dtype).train()
    ref = copy.deepcopy(model)  # before anything of ours touches the model
    ref.set_attn_implementation("eager")
    full = batch()
    ref_out = ref(**full, use_cache=False)
    ref_out.loss.backward()
    enable_hf_attention(model, None, "striped")
    summary = mixer_summary(model, n, full["input_ids"].size(1))  # the cost model's choice on so short a row
    assert summary.startswith(f"mixers: {mixer_count(model)} split ({kind}"), summary
    with exchanges() as calls:
        out = model(**shard_batch(full, n, rank, "striped"), use_cache=False)
        out.loss.backward()
    compare(model, ref, out.loss, ref_out.loss)
    assert calls == [4 * mixer_count(model)], (calls, mixer_count(model))


CASES = [(t, _case_family, (t,)) for t in FAMILIES]


@pytest.fixture(scope="module")
def results():
    return run_cases(2, CASES, timeout_s=600)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_splits_exact_on_2_ranks(results, name):
    check_case(results, name)


@pytest.mark.parametrize("model_type", sorted(PURE_SSM))
def test_attention_free_models_are_refused_by_name(model_type):
    from striped_sp.deepspeed import enable_hf_attention

    model = _model(model_type, PURE_SSM[model_type])
    with pytest.raises(ValueError, match=f"{type(model).__name__} mixes tokens outside attention .*no module calls "
                                         "transformers' attention functions"):
        enable_hf_attention(model, None, "striped")


def test_split_indices_are_made_once_per_device():
    """A split layer's index tensors (the conv rows of its channels, the groups each rank reads) are built
    and put on the device at the first call; later layers and batches reuse them (no copy per layer)."""
    from striped_sp.deepspeed.split.heads import conv_rows, head_groups

    rows = conv_rows([(0, 2, (1, 3)), (10, 1, (0,))])
    assert rows.tolist() == [2, 3, 6, 7, 10] and conv_rows([(0, 2, (1, 3)), (10, 1, (0,))]) is rows
    deal = head_groups(4, 8, 2)  # 8 heads in 2 groups over 4 ranks: two ranks read each group
    assert deal.groups_of == ((0,), (0,), (1,), (1,)) and deal.group_index().tolist() == [0, 0, 1, 1]
    assert head_groups(4, 8, 2).group_index() is deal.group_index()
    assert head_groups(4, 6, 2) == "6 heads are not divisible by 4 ranks"
    assert head_groups(2, 6, 3) == "6 heads in 3 groups do not deal evenly over 2 ranks"
