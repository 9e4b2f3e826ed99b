"""Hybrid models with real Mamba layers on CPU (tests only): megatron-core 0.16-0.17's
``MambaModel`` (``MambaStack``) and 0.18+'s ``HybridModel`` (``HybridStack``).

* :func:`mamba_layer_spec`: megatron-core's ``MambaLayer`` / ``MambaMixer`` with the local
  (non-Transformer-Engine) linear layers and a torch LayerNorm before the mixer;
* :func:`gdn_layer_spec`: megatron-core's gated delta net layer (0.18+), local linear layers;
* :func:`hybrid_model`: the model for a layer pattern (``'M'`` Mamba, ``'G'`` gated delta net,
  ``'*'`` attention, ``'-'`` MLP) on a CP group, float32, no dropout, Mamba's kernels replaced by
  :mod:`mamba_reference_ops`; its weights copied from ``like`` when given (a CP=1 reference), so
  both models hold the same numbers whatever the CP size did to the random draws;
* :func:`cp_groups`, :func:`compare_exact`, :func:`planted_order`: the 4-rank tests' groups,
  comparison and planted wrong orders (test_megatron_mamba.py, test_megatron_gdn.py);
* :func:`run_row`: one dense or packed row (padded documents too) through a CP=N model (the
  batch sliced by the plugin in ``algo``'s layout) and the same full row through a CP=1 reference
  (the plugin uninstalled: megatron-core's own RoPE and THD params); returns both losses.

Transformer Engine stand-ins: the stack's final ``TENorm`` is a torch LayerNorm; while a model is
built, ``torch.cuda.current_device()`` (the mixer's parameter device) is the CPU and the mixer's
CUDA RNG fork a no-op.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools

import torch

from megatron_layers import attention_and_mlp_specs
from megatron_reference import use_reference_attention

MAMBA = dict(mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2, mamba_num_heads=8)


class _Norm(torch.nn.LayerNorm):
    """Transformer Engine's ``TENorm`` (a class, as a spec's module must be) as a torch LayerNorm."""

    def __init__(self, config, hidden_size, eps=1e-5, **kwargs):
        super().__init__(hidden_size, eps=eps)


def _stack_module():
    """(block module, stack class, submodules class, model class, pattern keyword)."""
    try:
        from megatron.core.models.hybrid import hybrid_block as block
        from megatron.core.models.hybrid.hybrid_model import HybridModel as model
        return block, block.HybridStack, block.HybridStackSubmodules, model, "hybrid_layer_pattern", "hybrid_stack_spec"
    except ImportError:
        from megatron.core.models.mamba.mamba_model import MambaModel as model
        from megatron.core.ssm import mamba_block as block
        return block, block.MambaStack, block.MambaStackSubmodules, model, "hybrid_override_pattern", "mamba_stack_spec"


def mamba_layer_spec():
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
    from megatron.core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    mixer = ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
        in_proj=ColumnParallelLinear, out_proj=RowParallelLinear))
    return ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=_Norm, mixer=mixer, mamba_bda=get_bias_dropout_add))


def gdn_layer_spec():
    """megatron-core's gated delta net layer (0.18+: a ``TransformerLayer`` around ``GatedDeltaNet``,
    as ``hybrid_layer_specs`` builds it) with the local linear layers and torch LayerNorms in place
    of Transformer Engine's fused norm-linear and ``TENorm``."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=_Norm,
        self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=_Norm, out_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add))


#: gated delta net sizes: 4 key heads, 8 value heads of 8 (every head section divides by CP 4)
#: (and SiLU, the activation megatron-core's GDN convolution requires; the MLP layers use it too)
GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
           linear_num_key_heads=4, linear_num_value_heads=8, activation_func=torch.nn.functional.silu)


class _NoCudaRng:
    """The mixer draws its initial values inside ``get_cuda_rng_tracker().fork()``: on the CPU
    they come from the CPU generator (the values are copied from the reference anyway)."""

    @staticmethod
    def fork(*args, **kwargs):
        return contextlib.nullcontext()


@contextlib.contextmanager
def _cpu_device():
    from megatron.core.ssm import mamba_mixer

    try:  # megatron-core 0.19's gated delta net (its parameters and head permutation on the device)
        from megatron.core.ssm.gated_delta_net import common as gdn_common
    except ImportError:
        gdn_common = mamba_mixer
    saved = torch.cuda.current_device, mamba_mixer.get_cuda_rng_tracker, gdn_common.get_cuda_rng_tracker
    torch.cuda.current_device = lambda: "cpu"
    mamba_mixer.get_cuda_rng_tracker = gdn_common.get_cuda_rng_tracker = _NoCudaRng
    try:
        yield
    finally:
        torch.cuda.current_device, mamba_mixer.get_cuda_rng_tracker, gdn_common.get_cuda_rng_tracker = saved


def hybrid_model(group, pattern: str, vocab: int, like=None, seed: int = 1):
    """The hybrid model of ``pattern`` on ``group`` (see the module docstring)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from striped_sp.megatron.toy import pg_collection

    block, stack, submodules, model_cls, pattern_kw, spec_kw = _stack_module()
    block.TENorm = _Norm
    attention, mlp = attention_and_mlp_specs()
    layers = dict(attention_layer=attention, mlp_layer=mlp, mamba_layer=mamba_layer_spec())
    if "G" in pattern:
        layers["gdn_layer"] = gdn_layer_spec()
    spec = ModuleSpec(module=stack, submodules=submodules(**layers))
    config = TransformerConfig(num_layers=len(pattern), hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
                               num_query_groups=2, use_cpu_initialization=True, attention_dropout=0.0,
                               hidden_dropout=0.0, context_parallel_size=group.size(), **MAMBA,
                               **(GDN if "G" in pattern else {}))
    init = getattr(model_cls.__init__, "__wrapped__", model_cls.__init__)
    if pattern_kw not in inspect.signature(init).parameters:
        pattern_kw = "hybrid_layer_pattern"
    torch.manual_seed(seed)
    with _cpu_device():
        model = model_cls(config, **{spec_kw: spec}, vocab_size=vocab, max_sequence_length=64,
                          position_embedding_type="rope", pg_collection=pg_collection(group),
                          **{pattern_kw: pattern})
    if like is not None:
        model.load_state_dict(like.state_dict())
    return model


def reference_model(alone, pattern: str, vocab: int, seed: int = 1):
    """The CP=1 reference: ``pattern`` on a group of one, megatron-core's own layers with an
    independent float64 core attention put in (nothing of striped_sp runs in it)."""
    ref = hybrid_model(alone, pattern, vocab, seed=seed)
    use_reference_attention(ref, ref.config)
    return ref


def _cumulative(lengths):
    return [0, *itertools.accumulate(lengths)]


def run_row(model, ref, algo, group, seed, vocab, seq, docs=None):
    """One seeded row through ``model`` (CP = ``group``'s size; the batch sliced by the plugin in
    ``algo``'s layout) and ``ref`` (CP=1, the plugin uninstalled); backward on both.

    ``docs``: ``None`` (a dense row), document lengths (a packed THD row), or ``(real, padded)``
    lengths (each document's padding after its real tokens, out of the loss).  Returns
    ``(loss, ref_loss)``, the masked sums of the per-token losses."""
    import striped_sp.megatron as sm

    gen = torch.Generator().manual_seed(seed + 1)
    tokens, labels = (torch.randint(0, vocab, (1, seq), generator=gen) for _ in range(2))
    if docs is None:
        positions = torch.arange(seq)[None]
        with plugin_off():
            ref_loss = ref(tokens, positions, None, labels=labels).sum()
            ref_loss.backward()
        local = sm.get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "position_ids": positions},
                                             algo, cp_group=group)
        with _cpu_device():  # gated delta net asks for the CUDA device in its forward
            loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"]).sum()
            loss.backward()
        return loss, ref_loss
    real, padded = docs if isinstance(docs, tuple) else (docs, docs)
    bounds, padded_bounds = _cumulative(real), _cumulative(padded)
    assert padded_bounds[-1] == seq, (docs, seq)
    positions = torch.cat([torch.arange(n) for n in padded])[None]
    mask = torch.cat([(torch.arange(n) < r).float() for r, n in zip(real, padded)])[None]
    cu = torch.tensor(bounds, dtype=torch.int32)
    cu_padded = None if padded == real else torch.tensor(padded_bounds, dtype=torch.int32)
    with plugin_off():
        ref_loss = (ref(tokens, positions, None, labels=labels,
                        packed_seq_params=_reference_params(cu, cu_padded, max(padded))) * mask).sum()
        ref_loss.backward()
    local, params = sm.get_thd_batch_on_this_cp_rank(
        {"tokens": tokens, "labels": labels, "position_ids": positions, "loss_mask": mask}, cu, cu_padded,
        torch.tensor([max(padded)]), algo=algo, cp_group=group)
    with _cpu_device():
        loss = (model(local["tokens"], local["position_ids"], None, labels=local["labels"],
                      packed_seq_params=params) * local["loss_mask"]).sum()
        loss.backward()
    return loss, ref_loss


def _reference_params(cu, cu_padded, max_seqlen):
    """Megatron's own THD params for the CP=1 reference (its Mamba layers read the documents from
    them: ``seq_idx``), with ``total_tokens`` where megatron-core has it (0.19: ``seq_idx`` is
    built from it), as megatron-core's packed Mamba training builds them."""
    from megatron.core.packed_seq_params import PackedSeqParams

    kw = dict(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_padded,
              cu_seqlens_kv_padded=cu_padded, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)
    if "total_tokens" in getattr(PackedSeqParams, "__dataclass_fields__", {}):
        kw["total_tokens"] = int((cu if cu_padded is None else cu_padded)[-1])
    return PackedSeqParams(**kw)


@contextlib.contextmanager
def plugin_off():
    """The plugin uninstalled for the reference's forward and backward (megatron-core's own RoPE,
    for packed rows its THD path), then installed again."""
    import striped_sp.megatron as sm

    algo = sm.installed_algo()
    sm.uninstall()
    try:
        with _cpu_device():  # Megatron's own RoPE asks for the CUDA device (the plugin's fallback is off)
            yield
    finally:
        sm.install(algo)


# ---------------------------------------------------------------- shared by the Mamba and GDN tests (4 gloo ranks)

_GROUPS = {}


def cp_groups(cp):
    """(a group of this rank alone, this rank's CP group of ``cp`` ranks) in a world of 4: Megatron's
    own CP group for 4, the pairs [0, 2] / [1, 3] for 2 (made once per process, in step)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from striped_sp.megatron.toy import single_rank_group

    if not _GROUPS:
        parallel_state.initialize_model_parallel(context_parallel_size=dist.get_world_size())
        _GROUPS[1] = single_rank_group()
        _GROUPS[2] = [dist.new_group([0, 2]), dist.new_group([1, 3])][dist.get_rank() % 2]
        _GROUPS[4] = parallel_state.get_context_parallel_group()
    return _GROUPS[1], _GROUPS[cp]


def compare_exact(model, ref, loss, ref_loss, group, seed, loss_tol, grad_tol):
    """``loss`` summed over ``group`` equals ``ref_loss`` within ``loss_tol`` and every gradient
    summed over ``group`` the reference's within ``grad_tol`` (relative: largest error over the
    largest entry); ``AssertionError("... errors above ...")`` names the others.  Returns
    ``(loss error, worst gradient error)``."""
    import torch.distributed as dist

    from reference import rel_err

    total = loss.detach().clone()
    dist.all_reduce(total, group=group)
    errors = {"loss": rel_err(total, ref_loss.detach())}
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        errors[name] = rel_err(g, p_ref.grad)
    bad = {k: e for k, e in errors.items() if not e < (loss_tol if k == "loss" else grad_tol)}
    assert not bad, f"seed={seed}: errors above loss {loss_tol} / gradient {grad_tol}: {bad}"
    return errors["loss"], max(e for k, e in errors.items() if k != "loss")


@contextlib.contextmanager
def planted_order(planted):
    """A wrong gathered order in place of the layout's (striped_sp/megatron/mamba.py, which the
    GDN steps share): Megatron's own zigzag one (``"zigzag"``), none at all (``"none"``), or the
    layout's without the documents the packed batch was sliced by (``"no-documents"``)."""
    from striped_sp.megatron import gdn, mamba

    saved = mamba.gathered_order

    def wrong(seq_len, cp_size, layout, cu_seqlens=None):
        if planted == "none":
            return torch.arange(seq_len)
        return saved(seq_len, cp_size, "zigzag" if planted == "zigzag" else layout, None)

    def clear():
        mamba._dense_orders.cache_clear()
        gdn._packed_orders.cache_clear()

    mamba.gathered_order = wrong
    clear()
    try:
        yield
    finally:
        mamba.gathered_order = saved
        clear()
