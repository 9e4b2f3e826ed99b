"""Layer specs and a dense-row check shared by the hybrid-model tests (HybridModel, MambaModel).

``attention_and_mlp_specs``: an attention-only (``'*'``) and an MLP-only (``'-'``) layer spec cut
from megatron-core's local GPT layer spec.  ``check_dense_row``: one dense row through a CP=N
model (the batch sliced in ``algo``'s layout) and through its CP=1 reference (an independent
float64 core attention already put in), loss and every gradient compared.
"""

import copy

import torch

from megatron_reference import compare


def attention_and_mlp_specs(core_attention=None):
    """``(attention, mlp)`` layer specs; ``core_attention`` (a module class) replaces the spec's own
    (the spec providers return ours while ``install()`` is on: pass Megatron's to see a hook convert it)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp

    from striped_sp.megatron.spec import replace_core_attention

    layer = get_gpt_layer_local_spec()
    if core_attention is not None:
        layer = replace_core_attention(layer, core_attention)
    attention, mlp = copy.deepcopy(layer), copy.deepcopy(layer)
    attention.submodules.mlp, attention.submodules.pre_mlp_layernorm = IdentityOp, IdentityOp
    attention.submodules.mlp_bda = IdentityFuncOp
    mlp.submodules.self_attention, mlp.submodules.input_layernorm = IdentityOp, IdentityOp
    mlp.submodules.self_attn_bda = IdentityFuncOp
    return attention, mlp


def check_dense_row(model, ref, algo, group, seed, vocab, seq):
    """``model`` (CP = ``group``'s size, ``algo``) equals ``ref`` (CP=1) on one seeded dense row."""
    import striped_sp.megatron as sm

    gen = torch.Generator().manual_seed(seed + 1)
    tokens, labels = (torch.randint(0, vocab, (1, seq), generator=gen) for _ in range(2))
    positions = torch.arange(seq)[None]
    ref_loss = ref(tokens, positions, None, labels=labels).sum()
    local = sm.get_batch_on_this_cp_rank({"tokens": tokens, "labels": labels, "position_ids": positions},
                                         algo, cp_group=group)
    loss = model(local["tokens"], local["position_ids"], None, labels=local["labels"]).sum()
    ref_loss.backward()
    loss.backward()
    compare(model, ref, loss, ref_loss, group, seed)
