"""``ContextParallelAttention``: a megatron-core core-attention module that runs striped_sp.

It has the constructor and forward contract of megatron-core 0.16.1's core attention
(``DotProductAttention`` / ``TEDotProductAttention``): ``[s, b, heads, head_dim]`` query and
``[s, b, kv_heads, head_dim]`` key/value in, ``[s, b, heads * head_dim]`` out.  The CP group
comes from ``pg_collection.cp`` (else Megatron's parallel_state); the layout from ``algo``.
Every check runs in the constructor or before the ring starts.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..attention import ring_attention
from .arguments import layout_of

__all__ = ["ContextParallelAttention"]

_CAUSAL_TYPES = ("causal", "padding_causal")


def _group_size(group) -> int:
    return 1 if group is None else group.size()


class ContextParallelAttention(MegatronModule):
    """Exact context-parallel core attention in a striped_sp layout.

    Args (Megatron's, as ``DotProductAttention`` / ``TEDotProductAttention``): ``config``,
    ``layer_number``, ``attn_mask_type``, ``attention_type``, ``attention_dropout``,
    ``softmax_scale``, ``cp_comm_type``, ``pg_collection``, ``k_channels``, ``v_channels``,
    ``num_splits`` (accepted; unequal channels are refused).
    Args (ours): ``algo``: ``striped``, ``zigzag`` or ``ring``; ``backend``: the striped_sp
    kernel backend (``auto``, ``torch``, ``flash_attn``, ``math``).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        num_splits: Optional[int] = None,
        algo: str = "striped",
        backend: str = "auto",
    ):
        super().__init__(config=config)
        self.algo = algo
        self.layout = layout_of(algo)
        self.backend = backend
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        flag = f"--context-parallel-algo {algo}"

        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout and float(dropout) > 0:
            raise ValueError(
                f"{flag} does not support attention dropout yet (got {dropout}): "
                "set --attention-dropout 0 (TransformerConfig.attention_dropout=0.0)"
            )
        if cp_comm_type not in (None, "p2p"):
            raise ValueError(
                f"{flag} supports only --cp-comm-type p2p (got {cp_comm_type!r}): "
                "set --cp-comm-type p2p or use --context-parallel-algo native"
            )
        for name, channels in (("k_channels", k_channels), ("v_channels", v_channels)):
            if channels is not None and channels != config.kv_channels:
                raise ValueError(
                    f"{flag} needs one head_dim for query, key and value ({name}={channels}, "
                    f"kv_channels={config.kv_channels}): multi-latent attention is not supported "
                    "yet: drop --multi-latent-attention"
                )
        if attention_type != "self":
            raise ValueError(
                f"{flag} supports self-attention only (got attention_type={attention_type!r})"
            )
        if getattr(config, "window_size", None) is not None:
            raise ValueError(f"{flag} does not support sliding-window attention yet: drop --window-size")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(
                f"{flag} supports --softmax-type vanilla only (got {config.softmax_type!r})"
            )
        if getattr(config, "hybrid_context_parallel", False):
            raise ValueError(
                f"{flag} does not support hybrid context parallelism yet: drop --hybrid-context-parallel"
            )

        if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
            self.cp_group = pg_collection.cp
        else:
            self.cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        if tp is None:
            tp = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
        tp_size = _group_size(tp)

        head_dim = config.kv_channels
        self.hidden_size_per_attention_head = head_dim
        self.num_attention_heads_per_partition = config.num_attention_heads // tp_size
        self.num_query_groups_per_partition = max(1, config.num_query_groups // tp_size)
        self.hidden_size_per_partition = head_dim * self.num_attention_heads_per_partition

        # apply_query_key_layer_scaling divides the scores by layer_number and multiplies them
        # back inside the fp32 softmax: the net scale is the plain one.
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(head_dim)
        self.softmax_scale = float(softmax_scale)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        attn_mask_type: Optional[AttnMaskType] = None,
        attention_bias: Optional[torch.Tensor] = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """``[sq, b, heads, d]``, ``[sk, b, kv_heads, d]`` x2 -> ``[sq, b, heads * d]``.

        ``attention_mask`` is ignored for a causal ``attn_mask_type``, as Transformer Engine
        does: the causal mask is applied on global positions by the ring.
        """
        flag = f"--context-parallel-algo {self.algo}"
        if packed_seq_params is not None:
            raise ValueError(
                f"{flag} does not support packed THD sequences yet: drop sequence packing "
                "(--sft) or use --context-parallel-algo native"
            )
        if attention_bias is not None:
            raise ValueError(f"{flag} does not support an attention bias yet")
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        name = getattr(mask_type, "name", str(mask_type))
        if name in _CAUSAL_TYPES:
            causal = True
        elif name == "no_mask":
            causal = False
        else:
            raise ValueError(
                f"{flag} supports causal or no-mask attention only (got attn_mask_type={name})"
            )
        if name == "padding_causal" and attention_mask is not None:
            raise ValueError(f"{flag} does not support padding masks yet (attn_mask_type={name})")
        if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
            raise ValueError(
                f"{flag}: expected [s, b, heads, head_dim] query/key/value, got shapes "
                f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
            )
        if key.size(0) != query.size(0):
            raise ValueError(
                f"{flag} supports training and evaluation only, not inference/generation with a "
                f"KV cache (query has {query.size(0)} tokens, key {key.size(0)}): use "
                "--context-parallel-algo native for generation"
            )
        if key.size(-1) != value.size(-1) or query.size(-1) != key.size(-1):
            raise ValueError(
                f"{flag} needs one head_dim for query, key and value (got {query.size(-1)}, "
                f"{key.size(-1)}, {value.size(-1)}): multi-latent attention is not supported yet"
            )
        # [s, b, h, d] -> [b, s, h, d]
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        if self.cp_group is None:
            raise ValueError(
                f"{flag}: no context-parallel group: initialize Megatron's parallel_state or "
                "pass pg_collection with a cp group"
            )
        out = ring_attention(
            q, k, v, self.cp_group,
            layout=self.layout, causal=causal,
            softmax_scale=self.softmax_scale, backend=self.backend,
        )
        # [b, s, h, d] -> [s, b, h * d]
        out = out.transpose(0, 1)
        return out.reshape(out.size(0), out.size(1), -1)
