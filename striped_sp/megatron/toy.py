"""A tiny megatron-core GPT that runs on CPU: for the example trainer and the tests.

Megatron's parallel_state must be initialized first (``initialize_model_parallel``).  Each
model gets its own process-group collection, so one process can hold a CP=N model and a
CP=1 reference side by side: the reference simply gets a single-rank ``cp`` group.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .spec import patch_layer_spec

__all__ = ["single_rank_group", "pg_collection", "tiny_gpt", "all_reduce_grads"]


def single_rank_group() -> dist.ProcessGroup:
    """A group holding only this rank (collective: every rank of the world must call it)."""
    mine = None
    for r in range(dist.get_world_size()):
        g = dist.new_group([r])
        if r == dist.get_rank():
            mine = g
    return mine


def pg_collection(cp_group: Optional[dist.ProcessGroup] = None):
    """Megatron's process groups, with ``cp`` replaced by ``cp_group`` when given."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    pgc = ProcessGroupCollection.use_mpu_process_groups()
    if cp_group is not None:
        pgc.cp = cp_group
    return pgc


def tiny_gpt(
    cp_group: dist.ProcessGroup,
    algo: str = "striped",
    *,
    vocab_size: int = 64,
    max_seq_len: int = 256,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    layers: int = 2,
    position_embedding_type: str = "rope",
    seed: int = 1,
    mtp_layers: Optional[int] = None,
    init_std: float = 0.02,
    spec=None,
    **config_kw,
):
    """A ``GPTModel`` (float32, no dropout) whose attention runs ``algo`` on ``cp_group``.

    ``spec``: a layer spec to use instead of the local spec patched with ``algo``;
    ``config_kw``: more ``TransformerConfig`` fields.
    The same ``seed`` gives the same weights whatever the CP size.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    cp = cp_group.size()
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=hidden,
        ffn_hidden_size=2 * hidden,
        num_attention_heads=heads,
        num_query_groups=kv_heads,
        context_parallel_size=cp,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        mtp_num_layers=mtp_layers,
        init_method_std=init_std,
        **config_kw,
    )
    if spec is None:
        spec = patch_layer_spec(get_gpt_layer_local_spec(), algo)
    mtp_spec = None
    if mtp_layers:
        mtp_spec = patch_layer_spec(get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False), algo)
    torch.manual_seed(seed)
    model = GPTModel(
        config,
        spec,
        vocab_size=vocab_size,
        max_sequence_length=max_seq_len,
        position_embedding_type=position_embedding_type,
        mtp_block_spec=mtp_spec,
        pg_collection=pg_collection(cp_group),
    )
    if mtp_layers:
        # megatron-core 0.16.1's GPTModel builds its MTP block without its pg_collection, so MTP
        # falls back to parallel_state's CP group; point it at this model's group.
        for module in model.mtp.modules():
            if hasattr(module, "cp_group"):
                module.cp_group = cp_group
            if getattr(module, "pg_collection", None) is not None:  # RoPE of packed rows reads it
                module.pg_collection.cp = cp_group
    return model


def all_reduce_grads(model: torch.nn.Module, group: Optional[dist.ProcessGroup] = None, divide_by: float = 1.0):
    """Sum every parameter's gradient over ``group`` (DP x CP) and divide by ``divide_by``."""
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            if divide_by != 1.0:
                p.grad.div_(divide_by)
