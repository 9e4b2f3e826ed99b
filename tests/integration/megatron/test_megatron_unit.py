"""The Megatron adapter in one process: specs, core attention, install/uninstall, RoPE rows, patch, entry."""

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import types
import warnings

import pytest
import torch

import striped_sp
import striped_sp.megatron as sm
from reference import reference_attention, rel_err

warnings.filterwarnings("ignore")
pytest.importorskip("megatron.core")


# ---------------------------------------------------------------- specs and the core-attention module

def _core_attentions(spec):
    """Every core_attention builder in a spec tree."""
    found, seen = [], set()

    def walk(node):
        if node is None or id(node) in seen:
            return
        seen.add(id(node))
        if isinstance(node, (list, tuple)):
            for item in node:
                walk(item)
        elif dataclasses.is_dataclass(node) and not isinstance(node, type):
            for f in dataclasses.fields(node):
                if f.name == "core_attention":
                    found.append(getattr(node, f.name))
                elif f.name not in ("module", "params", "metainfo"):
                    walk(getattr(node, f.name))

    walk(spec)
    return found


def _config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                attention_dropout=0.0, hidden_dropout=0.0, use_cpu_initialization=True)
    base.update(kw)
    return TransformerConfig(**base)


def test_patch_layer_spec_layer_block_and_mtp():
    from megatron.core.models.gpt import gpt_layer_specs as gls

    from striped_sp.megatron.attention import ContextParallelAttention

    layer = gls.get_gpt_layer_local_spec()
    patched = sm.patch_layer_spec(layer, "zigzag")
    (ca,) = _core_attentions(patched)
    assert ca.module is ContextParallelAttention and ca.params["algo"] == "zigzag"
    assert _core_attentions(layer)[0] is not ca  # the input is untouched

    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec_for_backend,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    # what get_gpt_decoder_block_spec returns for MoE (it needs parallel_state to slice stages)
    moe = _config(num_moe_experts=4, moe_layer_freq=[1, 0], moe_ffn_hidden_size=32)
    block = TransformerBlockSubmodules(layer_specs=gls.get_gpt_decoder_layer_specs(moe, False))
    found = _core_attentions(sm.patch_layer_spec(block))
    assert len(found) == 2 and all(c.module is ContextParallelAttention for c in found)

    # what get_gpt_mtp_block_spec returns
    from megatron.core.models.backends import LocalSpecProvider

    mtp = MultiTokenPredictionBlockSubmodules(  # its first argument was renamed in 0.19
        layer_specs=[get_mtp_layer_spec_for_backend(layer, backend=LocalSpecProvider())])
    found = _core_attentions(sm.patch_layer_spec(mtp, "ring"))
    assert found and all(c.params["algo"] == "ring" for c in found)

    assert sm.patch_layer_spec(None) is None
    assert sm.patch_layer_spec(layer, "native") is layer
    with pytest.raises(ValueError, match="no core_attention"):
        sm.patch_layer_spec(gls.get_mlp_module_spec(use_te=False))


def test_core_attention_rejects_unsupported_settings():
    from megatron.core.transformer.enums import AttnMaskType

    group = types.SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    pgc = types.SimpleNamespace(cp=group, tp=types.SimpleNamespace(size=lambda: 1))
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", pg_collection=pgc)
    with pytest.raises(ValueError, match="--attention-dropout 0"):
        sm.ContextParallelAttention(_config(attention_dropout=0.1), **kw)
    with pytest.raises(ValueError, match="--cp-comm-type"):
        sm.ContextParallelAttention(_config(), cp_comm_type="allgather", **kw)
    with pytest.raises(ValueError, match="--context-parallel-algo"):
        sm.ContextParallelAttention(_config(), algo="native", **kw)
    with pytest.raises(ValueError, match="--no-rope-fusion"):  # MLA's fused RoPE assumes zigzag
        sm.ContextParallelAttention(_config(multi_latent_attention=True, apply_rope_fusion=True),
                                    k_channels=24, v_channels=8, **kw)
    mla = sm.ContextParallelAttention(_config(), k_channels=24, v_channels=8, **kw)  # MLA head dims
    assert (mla.hidden_size_per_attention_head, mla.value_head_dim) == (24, 8)
    # TEDotProductAttention's extra arguments are accepted when they mean plain attention
    sm.ContextParallelAttention(_config(), k_channels=8, v_channels=8, num_splits=None, **kw)
    attn = sm.ContextParallelAttention(_config(), algo="ring", **kw)
    assert attn.layout == "contiguous" and attn.cp_group is group
    q = torch.randn(6, 1, 4, 8)
    kv = torch.randn(6, 1, 2, 8)
    with pytest.raises(ValueError, match="'thd' format only"):
        attn(q, kv, kv, None, packed_seq_params=types.SimpleNamespace(qkv_format="sbhd"))
    with pytest.raises(ValueError, match="inference/generation"):
        attn(q, kv[:3], kv[:3], None)
    with pytest.raises(ValueError, match="attn_mask_type"):
        attn(q, kv, kv, None, attn_mask_type=AttnMaskType.arbitrary)
    # no pg_collection: the CP group comes from parallel_state (not initialized here)
    lone = sm.ContextParallelAttention(_config(), 1, AttnMaskType.causal, "self")
    assert lone.cp_group is None
    with pytest.raises(ValueError, match="no context-parallel group"):
        lone(q, kv, kv, None)


def test_core_attention_honours_backend_determinism_and_fp8_flags():
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType

    group = types.SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    pgc = types.SimpleNamespace(cp=group, tp=types.SimpleNamespace(size=lambda: 1))
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", pg_collection=pgc)
    for megatron_backend, ours in ((AttnBackend.unfused, "math"), (AttnBackend.fused, "torch"),
                                   (AttnBackend.auto, "auto"), (AttnBackend.local, "math")):
        attn = sm.ContextParallelAttention(_config(attention_backend=megatron_backend), **kw)
        assert attn.backend == ours and not attn.deterministic
    # a backend given in the spec wins over --attention-backend
    assert sm.ContextParallelAttention(_config(attention_backend=AttnBackend.unfused), backend="torch",
                                       **kw).backend == "torch"
    assert sm.ContextParallelAttention(_config(deterministic_mode=True), **kw).deterministic
    cfg = _config()
    cfg.fp8_dot_product_attention = True  # TransformerConfig itself needs TE for FP8
    with pytest.raises(ValueError, match="fp8_dot_product_attention=False"):
        sm.ContextParallelAttention(cfg, **kw)


def _one_rank_attention(group, **kw):
    from megatron.core.transformer.enums import AttnMaskType

    pgc = types.SimpleNamespace(cp=group, tp=types.SimpleNamespace(size=lambda: 1))
    kw.setdefault("attn_mask_type", AttnMaskType.causal)
    config = kw.pop("config", _config())
    return sm.ContextParallelAttention(config, 1, attention_type="self", pg_collection=pgc, softmax_scale=0.3,
                                       **kw)


def _sbhd_reference(q, k, v, causal):
    """Independent float64 attention on Megatron's [s, b, h, d] -> [s, b, h * d]."""
    out = reference_attention(*(t.transpose(0, 1) for t in (q, k, v)), causal, 0.3)
    return out.transpose(0, 1).reshape(q.size(0), q.size(1), -1)


def test_core_attention_mask_types_on_a_one_rank_ring(world_of_one):
    """no_mask is full attention and causal is causal, from the constructor or per call (a
    one-rank CP group through the real ring, against an independent float64 reference)."""
    from megatron.core.transformer.enums import AttnMaskType

    q, k, v = torch.randn(11, 2, 4, 8), torch.randn(11, 2, 2, 8), torch.randn(11, 2, 2, 8)
    full, causal = _sbhd_reference(q, k, v, False), _sbhd_reference(q, k, v, True)
    assert rel_err(full, causal) > 0.1  # the two masks give different answers on these inputs
    for mask_type, want in ((AttnMaskType.no_mask, full), (AttnMaskType.causal, causal)):
        assert rel_err(_one_rank_attention(world_of_one, attn_mask_type=mask_type)(q, k, v, None), want) < 1e-5
        per_call = _one_rank_attention(world_of_one)(q, k, v, None, attn_mask_type=mask_type)
        assert rel_err(per_call, want) < 1e-5


def test_core_attention_deterministic_mode_reaches_the_kernel(world_of_one, deterministic_flags):
    """--deterministic-mode is handed to the ring's kernel choice (on a one-rank CP group)."""
    q, k, v = torch.randn(7, 1, 4, 8), torch.randn(7, 1, 2, 8), torch.randn(7, 1, 2, 8)
    for mode in (True, False):
        deterministic_flags.clear()
        out = _one_rank_attention(world_of_one, config=_config(deterministic_mode=mode))(q, k, v, None)
        assert deterministic_flags and all(flag is mode for flag in deterministic_flags), (mode, deterministic_flags)
        assert rel_err(out, _sbhd_reference(q, k, v, True)) < 1e-5


def test_checkpoints_move_between_native_and_striped():
    """Where Transformer Engine's core attention was, ours keeps its ``_extra_state`` checkpoint
    entry (both directions load strictly); where the local spec's was, there is none."""
    from megatron.core.models.gpt import gpt_layer_specs as gls
    from megatron.core.transformer.spec_utils import ModuleSpec

    from striped_sp.megatron.attention import ContextParallelAttention, ContextParallelAttentionTEState
    from striped_sp.megatron.spec import replace_core_attention

    class TEDotProductAttention(torch.nn.Module):  # TE's state-dict contract, on CPU
        def __init__(self, *args, **kwargs):
            super().__init__()

        def get_extra_state(self):
            return torch.tensor([7], dtype=torch.uint8)  # FP8 metadata of a native run

        def set_extra_state(self, state):
            self.loaded = state

    from megatron.core.transformer.enums import AttnMaskType

    te_spec = replace_core_attention(gls.get_gpt_layer_local_spec(), ModuleSpec(module=TEDotProductAttention))
    (swapped,) = _core_attentions(sm.patch_layer_spec(te_spec, "striped"))
    assert swapped.module is ContextParallelAttentionTEState
    (swapped_twice,) = _core_attentions(sm.patch_layer_spec(sm.patch_layer_spec(te_spec), "striped"))
    assert swapped_twice.module is ContextParallelAttentionTEState  # GPTModel's own re-patching keeps it
    (local,) = _core_attentions(sm.patch_layer_spec(gls.get_gpt_layer_local_spec(), "striped"))
    assert local.module is ContextParallelAttention

    group = types.SimpleNamespace(size=lambda: 2, rank=lambda: 0)
    pgc = types.SimpleNamespace(cp=group, tp=types.SimpleNamespace(size=lambda: 1))
    kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", pg_collection=pgc)

    def holder(core):  # the layer's path to its core attention, with one weight beside it
        layer = torch.nn.Module()
        layer.self_attention = torch.nn.Module()
        layer.self_attention.core_attention = core
        layer.self_attention.linear_proj = torch.nn.Linear(2, 2)
        return layer

    native = holder(TEDotProductAttention())
    ours = holder(swapped.module(_config(), **swapped.params, **kw))
    native_sd, ours_sd = native.state_dict(), ours.state_dict()
    assert native_sd.keys() == ours_sd.keys() and "self_attention.core_attention._extra_state" in ours_sd
    ours.load_state_dict(native_sd, strict=True)    # native -> striped
    native.load_state_dict(ours_sd, strict=True)    # striped -> native (TE reads None as "no FP8")
    plain = holder(local.module(_config(), **local.params, **kw))
    assert not any("_extra_state" in k for k in plain.state_dict())


# ---------------------------------------------------------------- install / uninstall and RoPE

def _targets():
    from megatron.core import utils as core_utils
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding as rpe
    from megatron.core.models.common.embeddings import yarn_rotary_pos_embedding as yarn
    from megatron.core.models.gpt import gpt_layer_specs as gls, gpt_model
    from megatron.core.transformer import multi_token_prediction as mtp

    targets = {
        "rope_utils.get_pos_emb": (rope_utils, "get_pos_emb_on_this_cp_rank"),
        "rope_utils.apply": (rope_utils, "apply_rotary_pos_emb"),
        "rotary.get_pos_emb": (rpe, "get_pos_emb_on_this_cp_rank"),
        "yarn.get_pos_emb": (yarn, "get_pos_emb_on_this_cp_rank"),
        "RotaryEmbedding.get_emb": (rpe.RotaryEmbedding, "get_emb"),
        "YarnRotaryEmbedding.get_emb": (yarn.YarnRotaryEmbedding, "get_emb"),
        "utils.get_batch": (core_utils, "get_batch_on_this_cp_rank"),
        "utils.get_thd_batch": (core_utils, "get_thd_batch_on_this_cp_rank"),
        "specs.local": (gls, "get_gpt_layer_local_spec"),
        "specs.block": (gls, "get_gpt_decoder_block_spec"),
        "specs.mtp": (gls, "get_gpt_mtp_block_spec"),
        "mtp.roll": (mtp, "roll_tensor"),
        "gpt_model.roll": (gpt_model, "roll_tensor"),
    }
    # megatron-core 0.18 folded THD slicing into get_batch_on_this_cp_rank
    return {k: v for k, v in targets.items() if hasattr(v[0], v[1])}


def _snapshot():
    return {k: getattr(owner, attr) for k, (owner, attr) in _targets().items()}


def test_install_is_idempotent_and_uninstall_restores():
    sm.uninstall()
    before = _snapshot()
    sm.install("striped")
    after = _snapshot()
    changed = [k for k in before if after[k] is before[k]]
    assert not changed, f"install left these unpatched: {changed}"
    sm.install("striped")
    assert _snapshot() == after  # idempotent: nothing wrapped twice
    sm.install("zigzag")
    assert sm.installed_algo() == "zigzag" and _snapshot() == after
    sm.uninstall()
    assert _snapshot() == before and sm.installed_algo() is None
    sm.uninstall()
    assert _snapshot() == before
    sm.install("native")
    assert _snapshot() == before


def test_installed_spec_providers_return_our_attention():
    from megatron.core.models.gpt import gpt_layer_specs as gls

    from striped_sp.megatron.attention import ContextParallelAttention

    try:
        sm.install("ring")
        (ca,) = _core_attentions(gls.get_gpt_layer_local_spec())
        assert ca.module is ContextParallelAttention and ca.params["algo"] == "ring"
    finally:
        sm.uninstall()
    (ca,) = _core_attentions(gls.get_gpt_layer_local_spec())
    assert getattr(ca, "module", ca) is not ContextParallelAttention


class _FakeGroup:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


@pytest.mark.parametrize("algo", ["striped", "zigzag", "ring"])
def test_rope_rows_follow_positions_on_cpu(algo):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import YarnRotaryEmbedding

    seq, cp = 48, 4
    try:
        sm.install(algo)
        for rank in range(cp):
            group = _FakeGroup(cp, rank)
            pos = striped_sp.positions(seq, cp, rank, sm.layout_of(algo))
            # use_cpu_initialization=False: __init__ asks for the CUDA device, which install maps to CPU
            rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, cp_group=group)
            full = rope.get_emb(seq)
            assert full.device.type == "cpu"
            assert torch.equal(rope(seq), full.index_select(0, pos))
            yarn = YarnRotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True,
                                       cp_group=group)
            emb, _ = yarn(seq)
            full, _ = yarn.get_emb(seq)
            assert torch.equal(emb, full.index_select(0, pos))
    finally:
        sm.uninstall()


def _rope64(x, pos, inv_freq):
    """Independent non-interleaved RoPE in float64: token ``i`` of ``x [t, h, d]`` rotated by
    ``pos[i] * inv_freq`` (pairs ``(j, j + d/2)``, as Megatron's rotate-half)."""
    angle = pos.double()[:, None] * inv_freq.double()[None, :]  # [t, d/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    a, b = x.double().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)


@pytest.mark.parametrize("algo", ["striped", "zigzag", "ring"])
def test_thd_rope_rotates_by_the_position_inside_each_document(algo):
    """Packed THD rows: each local token gets the rotation of its position inside its document
    (checked directly on every rank of CP=4, not through a training run), and the global one only
    when the table has a row per token of the buffer (Megatron's rule)."""
    from striped_sp.megatron.rope import apply_rotary_pos_emb_thd

    cp = 4
    lengths = [16, 8, 24] if algo == "zigzag" else [13, 3, 9, 1, 6, 8]  # zigzag: multiples of 2 * cp
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    total, layout = bounds[-1], sm.layout_of(algo)
    start = torch.tensor([a for a, b in zip(bounds, bounds[1:]) for _ in range(b - a)])  # each token's document
    inv_freq = 1.0 / 10000 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    config = types.SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)
    x = torch.randn(total, 2, 8, dtype=torch.float64)
    for rows, want_pos in ((max(lengths), torch.arange(total) - start), (total, torch.arange(total))):
        table = torch.arange(rows, dtype=torch.float64)[:, None] * inv_freq[None, :]
        freqs = torch.cat((table, table), dim=-1)[:, None, None, :]  # [rows, 1, 1, d]
        want = _rope64(x, want_pos, inv_freq)
        for rank in range(cp):
            mine = striped_sp.positions(total, cp, rank, layout, bounds)
            if rows < total:
                assert torch.equal(striped_sp.document_positions(total, cp, rank, layout, bounds), want_pos[mine])
            got = apply_rotary_pos_emb_thd(x[mine], torch.tensor(bounds, dtype=torch.int32), freqs, config,
                                           _FakeGroup(cp, rank), algo=algo)
            assert (got - want[mine]).abs().max() < 1e-12, (rows, rank)


def test_native_rope_slicing_equals_megatrons_and_zigzag(monkeypatch):
    """Megatron's own RoPE slicing (run on CPU: its pin_memory and .cuda() patched out) is our
    zigzag layout, and our algo="native" path gives the same rows."""
    from megatron.core.models.common.embeddings import rope_utils

    tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, pin_memory=False, **k: tensor(*a, **k))
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    megatron_slice = getattr(rope_utils.get_pos_emb_on_this_cp_rank, "__striped_sp_original__",
                             rope_utils.get_pos_emb_on_this_cp_rank)
    emb = torch.randn(40, 1, 1, 8)
    for rank in range(4):
        g = _FakeGroup(4, rank)
        theirs = megatron_slice(emb, 0, g)
        assert torch.equal(theirs, striped_sp.shard(emb, 4, rank, dim=0, layout="zigzag"))
        assert torch.equal(sm.get_pos_emb_on_this_cp_rank(emb, 0, g, algo="native"), theirs)


def test_empty_pipeline_stage_spec_passes_through():
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    assert sm.patch_layer_spec([], "striped") == []
    block = sm.patch_layer_spec(TransformerBlockSubmodules(layer_specs=[]), "striped")
    assert block.layer_specs == []


def test_installed_gpt_model_patches_any_spec():
    """A spec that no patched provider returned (``--spec``, heterogeneous, user code) is
    patched by GPTModel.__init__ itself while installed; uninstall restores GPTModel.__init__."""
    import inspect

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from striped_sp.megatron import hooks
    from striped_sp.megatron.attention import ContextParallelAttention

    raw = get_gpt_layer_local_spec()  # unpatched: built before install
    original_init = GPTModel.__dict__["__init__"]
    seen = {}

    def fake_init(self, config, transformer_layer_spec, vocab_size, max_sequence_length,
                  pre_process=True, mtp_block_spec=None):
        seen.update(layer=transformer_layer_spec, mtp=mtp_block_spec, vocab=vocab_size)

    try:
        sm.install("striped")
        assert GPTModel.__dict__["__init__"] is not original_init
        assert inspect.signature(GPTModel.__init__) == inspect.signature(original_init)
        hooks._model_init_wrapper(fake_init)(None, "cfg", raw, 32, 16, mtp_block_spec=None)
        [ours] = _core_attentions(seen["layer"])
        assert ours.module is ContextParallelAttention and ours.params["algo"] == "striped"
        assert seen["vocab"] == 32 and seen["mtp"] is None
        [theirs] = _core_attentions(raw)  # the caller's spec is untouched
        assert getattr(theirs, "module", theirs) is not ContextParallelAttention
    finally:
        sm.uninstall()
    assert GPTModel.__dict__["__init__"] is original_init


def test_replacements_fall_back_after_uninstall():
    """A by-name copy taken while installed calls Megatron's function again after uninstall."""
    from megatron.core import utils as core_utils

    try:
        sm.install("striped")
        copy_taken_while_installed = core_utils.get_batch_on_this_cp_rank
    finally:
        sm.uninstall()
    calls = []
    original = copy_taken_while_installed.__striped_sp_original__
    copy_taken_while_installed.__striped_sp_original__ = lambda *a, **k: calls.append((a, k)) or "megatron"
    try:
        assert copy_taken_while_installed({"tokens": None}, cp_group="g") == "megatron"
    finally:
        copy_taken_while_installed.__striped_sp_original__ = original
    assert calls == [(({"tokens": None},), {"cp_group": "g"})]


def test_installed_hybrid_slicing_refuses():
    from megatron.core import utils as core_utils

    try:
        sm.install("striped")
        with pytest.raises(ValueError, match="hybrid context parallelism"):
            if hasattr(core_utils, "get_batch_on_this_hybrid_cp_rank"):  # up to 0.17
                core_utils.get_batch_on_this_hybrid_cp_rank({}, 2)
            else:  # 0.18+: a flag of get_batch_on_this_cp_rank
                core_utils.get_batch_on_this_cp_rank({"cu_seqlens": None}, is_hybrid_cp=True)
    finally:
        sm.uninstall()


# ---------------------------------------------------------------- the Megatron-LM patch

_PATCHES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                        "patches")
_TAGS = ("core_v0.16.1", "core_v0.17.1", "core_v0.18.2", "core_v0.19.0")
_SHARED_MLM = os.path.join(os.path.dirname(_PATCHES), "..", "shared", "megatron-lm")  # lexical: patches/ is a link


def _patch(tag):
    return os.path.join(_PATCHES, f"megatron_lm_{tag}_context_parallel_algo.patch")


def test_one_patch_per_release_line():
    assert sorted(os.listdir(_PATCHES)) == sorted(os.path.basename(_patch(t)) for t in _TAGS)


@pytest.mark.parametrize("tag", _TAGS)
def test_patch_applies_to_megatron_lm(tag):
    """``git apply --check`` of each patch against its Megatron-LM tag (``../shared/megatron-lm``,
    or ``MEGATRON_LM_DIR`` for the tag it is checked out at)."""
    root = os.environ.get("MEGATRON_LM_DIR") if os.environ.get("MEGATRON_LM_TAG") == tag else None
    root = root or os.path.join(_SHARED_MLM, tag)
    if not os.path.isfile(os.path.join(root, "pretrain_gpt.py")):
        pytest.skip(f"no Megatron-LM {tag} sources: set MEGATRON_LM_DIR and MEGATRON_LM_TAG={tag}")
    if shutil.which("git") is None:
        pytest.skip("git not found")
    res = subprocess.run(["git", "apply", "--check", os.path.abspath(_patch(tag))], cwd=root,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


# ---------------------------------------------------------------- the no-patch entry

def test_entry_hooks_megatron_parse_and_validate(tmp_path, monkeypatch):
    from striped_sp.megatron import pretrain_gpt as entry

    calls = []

    argv = ["--context-parallel-size", "2", "--seq-length", "64", "--context-parallel-algo", "striped",
            "--extra", "1"]

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser()
        parser.add_argument("--context-parallel-size", type=int, default=1)
        parser.add_argument("--seq-length", type=int, default=None)
        parser.add_argument("--yaml-cfg", type=str, default=None)
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return parser.parse_args(argv)

    def validate_args(args, defaults={}):
        calls.append("megatron")

    def other_provider(parser):
        parser.add_argument("--extra", type=int)
        return parser

    fake = types.SimpleNamespace(parse_args=parse_args, validate_args=validate_args)
    entry.hook_initialize(fake)
    entry.hook_initialize(fake)  # idempotent
    args = fake.parse_args(other_provider)
    assert (args.context_parallel_algo, args.extra) == ("striped", 1)
    try:
        fake.validate_args(args, {})
        assert calls == ["megatron"] and sm.installed_algo() == "striped"
    finally:
        sm.uninstall()
    args.context_parallel_size = 1
    with pytest.raises(ValueError, match="--context-parallel-size"):
        fake.validate_args(args, {})
    argv += ["--yaml-cfg", "run.yaml"]  # Megatron would skip validate_args: refused at parse time
    with pytest.raises(ValueError, match="--yaml-cfg"):
        fake.parse_args(other_provider)

    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="MEGATRON_LM_DIR"):
        entry.find_megatron_lm()
    (tmp_path / "pretrain_gpt.py").write_text("")
    assert entry.find_megatron_lm() == str(tmp_path)


def test_install_reaches_by_name_copies_in_loaded_scripts(monkeypatch):
    """pretrain_gpt.py imports get_batch_on_this_cp_rank by name: install patches that copy too."""
    from megatron.core import utils as core_utils

    original = core_utils.get_batch_on_this_cp_rank
    script = types.ModuleType("pretrain_gpt")
    script.get_batch_on_this_cp_rank = original
    script.unrelated = len
    monkeypatch.setitem(sys.modules, "pretrain_gpt", script)
    try:
        sm.install("striped")
        assert script.get_batch_on_this_cp_rank is core_utils.get_batch_on_this_cp_rank is not original
        assert script.unrelated is len
    finally:
        sm.uninstall()
    assert script.get_batch_on_this_cp_rank is original is core_utils.get_batch_on_this_cp_rank


def test_striped_calibrate_times_the_kernel_once_when_the_model_is_built(monkeypatch):
    """--striped-calibrate: validate_args asks for it (refused with native, which does not run this
    engine); the first core attention built calibrates on its CP group, once per process, and every
    plan and auto choice for that kernel on this device then uses the measured model."""
    import types as _types

    from megatron.core.transformer.enums import AttnMaskType
    from striped_sp.engine import calibration
    from striped_sp.megatron import arguments, attention
    from striped_sp.plan import cost, search

    args = _types.SimpleNamespace(context_parallel_algo="striped", context_parallel_size=2, seq_length=64,
                                  striped_calibrate=True)
    with pytest.raises(ValueError, match="--striped-calibrate .* native"):
        sm.validate_args(_types.SimpleNamespace(context_parallel_algo="native", striped_calibrate=True))
    with pytest.raises(ValueError, match="--striped-calibrate with --pipeline-model-parallel-size 2"):
        sm.validate_args(_types.SimpleNamespace(**{**vars(args), "pipeline_model_parallel_size": 2}))
    assert not arguments._CALIBRATION["pending"]
    calls = []
    real = calibration.calibrate_cost_model
    monkeypatch.setattr(attention, "calibrate_cost_model", lambda **kw: calls.append(kw) or real(**kw))
    search._placed_runs.cache_clear()  # no batch placed yet in this process
    try:
        sm.validate_args(args)
        cp = _types.SimpleNamespace(size=lambda: 2, rank=lambda: 0)  # a CP group (of 2 of the ranks)
        pgc = _types.SimpleNamespace(cp=cp, tp=_types.SimpleNamespace(size=lambda: 1))
        kw = dict(layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self", pg_collection=pgc)
        for layer in range(3):
            sm.ContextParallelAttention(_config(), **{**kw, "layer_number": layer + 1})
        # over every rank (group None): tensor-parallel peers in other CP groups shard by the same model
        assert len(calls) == 1 and calls[0]["group"] is None, calls
        assert calls[0]["backend"] == "auto" and calls[0]["head_dim"] == 8, calls
        model = cost.model_for("torch", "cpu")
        assert model.measured and model.label == "torch@cpu" and cost.default_model() is model
        assert model.ns_per_entry > 0, model  # timed here, not an all-zero model adopted untimed
        sm.validate_args(_types.SimpleNamespace(**{**vars(args), "striped_calibrate": False}))
        sm.ContextParallelAttention(_config(), **kw)
        assert len(calls) == 1  # without the flag: nothing more
    finally:
        cost.use_model(None)
        arguments._CALIBRATION["pending"] = False
