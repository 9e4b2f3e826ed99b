"""``ContextParallelAttention``: a megatron-core core-attention module that runs striped_sp.

It has the constructor and forward contract of megatron-core 0.16.1's core attention
(``DotProductAttention`` / ``TEDotProductAttention``): ``[s, b, heads, head_dim]`` query and
``[s, b, kv_heads, head_dim]`` key/value in, ``[s, b, heads * head_dim]`` out; under multi-latent
attention (``MLASelfAttention``: ``k_channels`` = qk_head_dim + qk_pos_emb_head_dim, ``v_channels``
= v_head_dim) value and output have v's head dim.  The CP group comes from ``pg_collection.cp``
(else Megatron's parallel_state); the layout from ``algo``.  Packed THD rows
(``packed_seq_params``: ``[t, heads, head_dim]`` in, ``[t, heads * head_dim]`` out), document
masks from ``--reset-attention-mask`` and ``--window-size`` (with
``window_attn_skip_freq``) become the ring's documents and window.  Every check runs in the
constructor or before the ring starts.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..engine.agreement import agreeing
from ..engine.calibration import calibrate_cost_model
from ..plan.layouts import get_layout, positions
from ..engine.request import RingRequest
from . import packed
from .arguments import kernel_backend_of, layout_of, rows_layout, take_calibration

__all__ = ["ContextParallelAttention", "ContextParallelAttentionTEState"]

_CAUSAL_TYPES = ("causal", "padding_causal")


def _group_size(group) -> int:
    return 1 if group is None else group.size()


class ContextParallelAttention(MegatronModule):
    """Exact context-parallel core attention in a striped_sp layout.

    Args (Megatron's, as ``DotProductAttention`` / ``TEDotProductAttention``): ``config``,
    ``layer_number``, ``attn_mask_type``, ``attention_type``, ``attention_dropout``,
    ``softmax_scale``, ``cp_comm_type``, ``pg_collection``, ``k_channels``, ``v_channels``,
    ``num_splits`` (accepted).  ``k_channels`` / ``v_channels`` (default ``kv_channels``) are the
    query/key and value head dims; they differ under multi-latent attention, whose RoPE Megatron
    applies to the positional part of q/k before this module (at the layout's positions once
    :func:`striped_sp.megatron.install` ran); its fused MLA RoPE is refused.
    Args (ours): ``algo``: ``striped``, ``zigzag`` or ``ring``, or a striped layout key
    (``"striped:stripe=4,place=auto"``, :func:`~striped_sp.megatron.algo_of`); ``backend``: the striped_sp
    kernel backend (``auto``, ``torch``, ``flash_attn``, ``math``); ``auto`` follows
    ``config.attention_backend`` (``--attention-backend``: flash -> flash_attn, fused -> torch,
    unfused/local -> math).  ``config.deterministic_mode`` asks for a reproducible backward; FP8
    attention is refused.  ``config.softmax_type`` ``learnable`` / ``off-by-one``: attention sinks,
    ``softmax_offset`` held as megatron-core's ``DotProductAttention`` holds it (same name, shape,
    init and sharded state dict) and folded into the ring's lse once per row.
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
        #: the layout key (``"striped"``, or ``"striped:stripe=4,place=auto"`` from --striped-* flags)
        self.layout = layout_of(algo)
        self._layout = get_layout(self.layout)
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
        if cp_comm_type not in (None, "p2p", "a2a", "a2a+p2p"):
            raise ValueError(
                f"{flag} supports --cp-comm-type p2p (the ring), a2a (Ulysses) and a2a+p2p (Ulysses "
                f"inside, the ring across), got {cp_comm_type!r}: choose one of those or use "
                "--context-parallel-algo native"
            )
        self.cp_comm_type = cp_comm_type or "p2p"
        if getattr(config, "multi_latent_attention", False) and getattr(config, "apply_rope_fusion", False):
            raise ValueError(
                f"{flag}: the fused multi-latent attention RoPE (apply_rope_fusion) places its rotary "
                "rows by Megatron's zigzag chunks, not by the layout's positions: pass --no-rope-fusion"
            )
        if attention_type != "self":
            raise ValueError(
                f"{flag} supports self-attention only (got attention_type={attention_type!r})"
            )
        self.window_size = _layer_window(config, self.layer_number)
        for name in ("fp8_dot_product_attention", "fp8_multi_head_attention"):
            if getattr(config, name, False):
                raise ValueError(f"{flag} does not run FP8 attention: set {name}=False in the TransformerConfig")
        if backend == "auto":  # the spec left it to Megatron's --attention-backend
            self.backend = kernel_backend_of(getattr(config, "attention_backend", None))
        #: --deterministic-mode: a reproducible backward (refused on kernels that have none)
        self.deterministic = bool(getattr(config, "deterministic_mode", False))
        #: --softmax-type: vanilla, off-by-one (a fixed zero sink logit) or learnable (a parameter)
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        if self.softmax_type not in ("vanilla", "off-by-one", "learnable"):
            raise ValueError(f"{flag} supports --softmax-type vanilla, off-by-one or learnable "
                             f"(got {self.softmax_type!r})")
        if getattr(config, "hybrid_context_parallel", False):
            raise ValueError(
                f"{flag} does not support hybrid context parallelism yet: drop --hybrid-context-parallel"
            )

        if pg_collection is not None and getattr(pg_collection, "cp", None) is not None:
            self.cp_group = pg_collection.cp
        else:
            self.cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        self.ulysses_groups = _ulysses_groups(self.cp_comm_type, self.cp_group, pg_collection, flag)
        tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
        if tp is None:
            tp = parallel_state.get_tensor_model_parallel_group(check_initialized=False)
        tp_size = _group_size(tp)

        head_dim = config.kv_channels if k_channels is None else k_channels
        #: v's head dim (multi-latent attention: v_head_dim, unlike q/k's)
        self.value_head_dim = config.kv_channels if v_channels is None else v_channels
        self.hidden_size_per_attention_head = head_dim
        self.num_attention_heads_per_partition = config.num_attention_heads // tp_size
        self.num_query_groups_per_partition = max(1, config.num_query_groups // tp_size)
        self.hidden_size_per_partition = self.value_head_dim * self.num_attention_heads_per_partition

        if take_calibration():  # --striped-calibrate: the first layer built, on every rank, before any batch
            # over every rank (not the CP group): tensor- and data-parallel peers shard the same or their
            # own batches by the same `auto` choices, so all must hold one model (validate_args
            # refuses pipeline parallelism, where a stage might build no attention and never join)
            calibrate_cost_model(group=None, backend=self.backend, head_dim=head_dim,
                                 dtype=getattr(config, "params_dtype", None) if torch.cuda.is_available() else None)

        _make_softmax_offset(self, config, self.num_attention_heads_per_partition)
        #: for the sharded state dict (the TP split of softmax_offset), as Megatron's core attention
        self.tp_group = tp

        # apply_query_key_layer_scaling divides the scores by layer_number and multiplies them
        # back inside the fp32 softmax: the net scale is the plain one.
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(head_dim)
        self.softmax_scale = float(softmax_scale)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """As megatron-core's ``DotProductAttention`` / ``TEDotProductAttention``: the learnable
        ``softmax_offset`` split over TP along its only axis; nothing else."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        state_dict = self.state_dict(prefix="", keep_vars=True) if self.softmax_type == "learnable" else {}
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"])

    def _sinks(self, device):
        """The sink logits ``[heads per TP partition]`` (``None`` under vanilla softmax)."""
        sinks = self.softmax_offset
        if sinks is not None and sinks.device != device and not isinstance(sinks, torch.nn.Parameter):
            self.softmax_offset = sinks = sinks.to(device)  # off-by-one's zeros, once (not a buffer)
        return sinks

    def _documents(self, attention_mask, local_len: int, batch: int):
        """Per-row document bounds of a bshd batch from its mask, or ``None`` (one document)."""
        if attention_mask is None:
            return None
        documents = packed.attached(attention_mask)
        if documents is None:
            documents = _vet_local_mask(attention_mask, self.cp_group, self.layout, local_len)
        if all(len(b) == 2 for b in documents):
            return None
        if len(documents) not in (1, batch):
            raise ValueError(f"attention_mask holds {len(documents)} rows of documents for a batch of {batch}")
        return documents

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
        """``[sq, b, heads, d]``, ``[sk, b, kv_heads, d]``, ``[sk, b, kv_heads, dv]`` -> ``[sq, b, heads * dv]``
        (``dv = d`` but under multi-latent attention); with THD ``packed_seq_params``: ``[t, heads, d]``,
        ``[t, kv_heads, d]``, ``[t, kv_heads, dv]`` -> ``[t, heads * dv]``.

        The causal mask is applied on global positions by the ring.  ``attention_mask`` (bool,
        ``True`` = masked) may only be causal inside documents: the documents come from the batch
        slicing (``--reset-attention-mask``); a mask from elsewhere must be plain causal.
        """
        flag = f"--context-parallel-algo {self.algo}"
        thd = packed_seq_params is not None
        if thd and getattr(packed_seq_params, "qkv_format", None) != "thd":
            raise ValueError(f"{flag} supports packed rows in the 'thd' format only (got "
                             f"qkv_format={getattr(packed_seq_params, 'qkv_format', None)!r})")
        if thd and query.dim() == 3:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
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
        if query.size(-1) != key.size(-1):
            raise ValueError(
                f"{flag} needs one head_dim for query and key (got {query.size(-1)} and {key.size(-1)}); "
                f"value's may differ (multi-latent attention, got {value.size(-1)})"
            )
        # [s, b, h, d] -> [b, s, h, d]
        q, k, v = (t.transpose(0, 1) for t in (query, key, value))
        if self.cp_group is None:
            raise ValueError(
                f"{flag}: no context-parallel group: initialize Megatron's parallel_state or "
                "pass pg_collection with a cp group"
            )
        size = _group_size(self.cp_group)
        seq_len = q.size(1) * size
        if thd:
            if q.size(0) != 1:
                raise ValueError(f"{flag}: packed THD rows have batch 1, got query {tuple(query.shape)}")
            bounds = packed.documents_of(packed_seq_params, seq_len, self.layout)
            if not causal and packed.keeps_padding(self.layout) and _padded(packed_seq_params):
                raise ValueError(f"{flag} keeps padding inside its document, which only causal attention "
                                 "ignores: use --context-parallel-algo striped (--striped-doc-placement "
                                 "split) for this mask")
            rows = [bounds if len(bounds) > 2 else None]
        else:
            documents = self._documents(attention_mask, q.size(1), q.size(0))
            rows = None if documents is None else [documents[i % len(documents)] for i in range(q.size(0))]
        layout = self.layout if thd else rows_layout(self.layout, seq_len, size)  # as the batch slicing placed [b, s] rows
        if rows is None or rows == [None]:
            out = self._ring(q, k, v, causal, None, layout)
        elif get_layout(layout).flattens_rows(q.size(1)):
            # A [b, s/N] striped shard is the striped shard of the b rows laid end to end.
            flat = packed.flatten_rows(tuple(rows), len(rows))
            out = self._ring(*(t.reshape(1, -1, *t.shape[2:]) for t in (q, k, v)), causal, flat, layout)
            out = out.view(*q.shape[:-1], v.size(-1))
        else:
            out = torch.cat([self._ring(q[i:i + 1], k[i:i + 1], v[i:i + 1], causal, rows[i], layout)
                             for i in range(q.size(0))])
        if thd:  # [1, t, h, d] -> [t, h * d]
            return out[0].reshape(out.size(1), -1)
        # [b, s, h, d] -> [s, b, h * d]
        out = out.transpose(0, 1)
        return out.reshape(out.size(0), out.size(1), -1)

    def _request(self, causal: bool, layout: str | None = None) -> RingRequest:
        """This layer's ring request for ``causal`` (built once; again only if a setting changed)."""
        layout = self.layout if layout is None else layout
        key = (causal, self.cp_group, layout, self.softmax_scale, self.backend, self.window_size,
               self.deterministic, self.ulysses_groups)
        requests = self.__dict__.setdefault("_requests", {})
        request = requests.get(key)
        if request is None:
            request = requests[key] = RingRequest(
                self.cp_group, layout=layout, causal=causal, softmax_scale=self.softmax_scale,
                backend=self.backend, window_size=self.window_size, deterministic=self.deterministic,
                ulysses_groups=self.ulysses_groups, sharded_by_documents=True)  # get_batch shards by documents
        return request

    def _ring(self, q, k, v, causal: bool, cu_seqlens, layout: str | None = None):
        request = self._request(causal, layout)
        return (request if cu_seqlens is None else request.derive(cu_seqlens=cu_seqlens))(
            q, k, v, sinks=self._sinks(q.device))


class ContextParallelAttentionTEState(ContextParallelAttention):
    """:class:`ContextParallelAttention` in place of Transformer Engine's ``TEDotProductAttention``:
    its state dict carries the ``_extra_state`` entry TE's has (TE keeps FP8 scaling metadata
    there), so a checkpoint of a ``native`` run loads here and one of ours loads into ``native``.
    FP8 attention is refused, so a loaded entry is dropped and ``None`` is saved (which TE reads
    as "no FP8 metadata")."""

    def get_extra_state(self):
        return None

    def set_extra_state(self, state) -> None:
        pass


def _make_softmax_offset(module, config, heads: int) -> None:
    """``softmax_offset`` as megatron-core's ``DotProductAttention`` makes it: ``None`` (vanilla),
    fixed zeros (off-by-one: a plain tensor, not in the state dict) or a learnable parameter, one
    per query head of this TP partition, in ``params_dtype``, drawn with ``config.init_method``
    (the same draw at the same point of the model's construction, so weights match a native build)."""
    kind = module.softmax_type
    device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
    dtype = config.params_dtype
    if kind == "vanilla":
        module.softmax_offset = None
    elif kind == "off-by-one":
        module.softmax_offset = torch.zeros(heads, device=device, dtype=dtype)
    else:
        module.register_parameter("softmax_offset", torch.nn.Parameter(torch.empty(heads, device=device, dtype=dtype)))
        if config.perform_initialization:
            module.softmax_offset = config.init_method(module.softmax_offset)


def _ulysses_groups(cp_comm_type: str, cp_group, pg_collection, flag: str):
    """``(inner, outer)`` for hierarchical CP, from Megatron's own groups, or ``None`` (the ring).

    ``a2a``: Ulysses over the whole CP group (a ring of one).  ``a2a+p2p``: Megatron's
    hierarchical CP groups (``--hierarchical-context-parallel-sizes u r``): level 1 is ``u``
    consecutive CP ranks, level 2 every ``u``-th one, the mapping the engine uses."""
    if cp_comm_type == "p2p":
        return None
    if cp_comm_type == "a2a":
        return (cp_group, None)
    groups = getattr(pg_collection, "hcp", None) if pg_collection is not None else None
    if groups is None:
        groups = parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False)
    if not groups or len(groups) != 2:
        raise ValueError(
            f"{flag} with --cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes with two "
            f"sizes (Ulysses group, ring), got {0 if not groups else len(groups)} levels of groups")
    return tuple(groups)


def _padded(params) -> bool:
    pad = getattr(params, "cu_seqlens_q_padded", None)
    return pad is not None and not torch.equal(torch.as_tensor(pad).cpu(), torch.as_tensor(params.cu_seqlens_q).cpu())


def _layer_window(config, layer_number: int):
    """The ``(left, right)`` window of this layer (``--window-size``, with
    ``window_attn_skip_freq`` choosing the full-attention layers), or ``None``."""
    window = getattr(config, "window_size", None)
    if window is None:
        return None
    skip = getattr(config, "window_attn_skip_freq", None)
    try:
        from megatron.core.transformer.utils import is_layer_window_attention
    except ImportError:  # megatron-core without per-layer patterns
        return tuple(window) if skip is None else None
    return tuple(window) if is_layer_window_attention(window, skip, layer_number) else None


def _vet_local_mask(mask: torch.Tensor, group, layout: str, local_len: int):
    """A mask that did not come through our batch slicing: accept it only if its local rows are
    the plain causal mask (what the ring runs); documents need :func:`get_batch_on_this_cp_rank`.
    Once per mask object; the ranks agree (:func:`striped_sp.engine.agreement.agreeing`, one small exchange)
    before any of them raises, so a rank whose rows look causal never waits in the ring for one that
    refused."""
    size = _group_size(group)
    rank = 0 if group is None else group.rank()
    what = "attention_mask"
    try:  # the ranks meet on every new mask (one small exchange), so all raise if any does
        with agreeing(group, what=what, device=mask.device, enabled=size > 1, cached=False):
            rows = positions(local_len * size, size, rank, layout).to(mask.device)
            m = mask[:, 0] if mask.dim() == 4 else mask
            if m.dim() != 3 or m.size(1) != local_len or m.size(2) != local_len * size:
                raise ValueError(f"attention_mask has shape {tuple(mask.shape)}: expected [b, 1, {local_len}, "
                                 f"{local_len * size}] (this rank's query rows, every key)")
            documents = packed.documents_from_mask(mask, rows=rows)
            if any(len(b) > 2 for b in documents):
                raise ValueError("its rows hold document starts")
    except ValueError as error:
        if str(error).startswith(f"{what}: rank ") and " of the group refused: " in str(error):
            error = "another rank's rows of it are not plain causal"
        raise ValueError(
            f"attention_mask is not plain causal ({error}) and did not come through striped_sp's batch "
            "slicing, which reads --reset-attention-mask documents from the full mask: slice batches with "
            "striped_sp.megatron.get_batch_on_this_cp_rank (install() makes Megatron's own do it)") from None
    packed.attach(mask, documents)
    return documents
