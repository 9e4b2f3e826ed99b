"""The setup line of the Megatron route: what :mod:`.hooks` logs on global rank 0 when the first
model is built under ``install()`` (:func:`striped_sp.setup_report.setup_line`: layout, CP groups,
kernel and why, stripes, cost model).  Megatron's argument dump gets the layout from
:func:`.arguments.note_layout`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["setup_line"]


def _dtype(config) -> torch.dtype:
    if getattr(config, "bf16", False):
        return torch.bfloat16
    if getattr(config, "fp16", False):
        return torch.float16
    return getattr(config, "params_dtype", None) or torch.float32


def setup_line(model, algo: str) -> str | None:
    """The setup line for ``model`` (just built, its core attention ours), or ``None`` where it
    holds no core attention of ours (a pipeline stage without attention layers)."""
    from ..setup_report import setup_line as line
    from .attention import ContextParallelAttention

    if not hasattr(model, "modules"):  # not a module (a test's stand-in): nothing to report
        return None
    attention = next((m for m in model.modules() if isinstance(m, ContextParallelAttention)), None)
    if attention is None:
        return None
    group = attention.cp_group
    size = group.size() if group is not None else 1
    if dist.is_available() and dist.is_initialized() and group is not None:
        world = dist.get_world_size()
        where = f"ranks {dist.get_process_group_ranks(group)} of {world}, {world // size} CP groups"
    else:
        where = "one process"
    head_dim = attention.hidden_size_per_attention_head
    if attention.value_head_dim != head_dim:
        head_dim = (head_dim, attention.value_head_dim)
    text = line(f"Megatron, --context-parallel-algo {algo}", attention.layout,
                f"CP size {size} ({where}; --cp-comm-type {attention.cp_comm_type})", attention.backend,
                "cuda" if torch.cuda.is_available() else "cpu", _dtype(model.config), head_dim,
                "--striped-calibrate measures it",
                gqa=attention.num_query_groups_per_partition < attention.num_attention_heads_per_partition)
    if attention.softmax_type != "vanilla":  # --softmax-type: the sink logit folded into the ring's lse
        text += f"; sinks {attention.softmax_type}"
    return text
