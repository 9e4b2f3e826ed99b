"""Drop-in for ``deepspeed.sequence.layer.DistributedAttention`` that runs the ring engine.

DeepSpeed's Ulysses module all-to-alls q/k/v from local tokens x all heads to all tokens x local
heads, runs ``local_attention`` and all-to-alls back.  This one keeps the same constructor, forward
signature and shapes, but never gathers the sequence: q/k/v stay local (tokens in the configured
layout, striped by default) and the KV blocks travel round the ring.  So the head count need not
be divisible by the group size, and GQA kv heads travel unexpanded.

``local_attention`` is kept (as ``local_attn``, for state dicts and attribute access) but not
called: the attention is causal softmax attention, as in Megatron-DeepSpeed's GPT models.  Its
``causal`` and ``softmax_scale`` attributes, when present (``FlashSelfAttention`` has both), are the
defaults for the keyword arguments of the same names.  Extra forward arguments (e.g. a causal
``attention_mask`` for ``CoreAttention``) are accepted and ignored.

Packed documents and sliding windows: ``forward(..., cu_seqlens=...)`` (or ``cu_seq_lens_q=``, as
:func:`.shard_batch` names them) takes the document boundaries of the *global* packed row;
``window_size=(left, right)`` (flash-attn convention) or ``sliding_window=W`` (transformers'
convention, ``= (W - 1, 0)``), given to the constructor or to one forward call, sets a window.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from ..plan.layouts import ALGOS
from ..engine.request import RingRequest, window_of
from .packed import batch_bounds, device_positions

__all__ = ["DistributedAttention"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def _apply_rotary(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``cos.size(-1)`` channels of ``t`` (rotate-half convention, as DeepSpeed)."""
    rot = cos.size(-1)
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    t_rot = t_rot * cos + _rotate_half(t_rot) * sin
    return t_rot if t_pass.size(-1) == 0 else torch.cat([t_rot, t_pass], dim=-1)


_KEEP = object()  # configure(): leave a setting as it is


class DistributedAttention(torch.nn.Module):
    """Same constructor as DeepSpeed's: ``(local_attention, sequence_process_group, scatter_idx=2,
    gather_idx=0, sp_stream=None, num_kv_heads=None)``, plus keyword-only ``layout`` (a core layout
    name, or the config algo names ``"ring"``), ``causal``, ``softmax_scale``, ``backend`` and a
    window (``window_size=(left, right)`` or ``sliding_window=W``).

    ``forward(query, key, value, batch_dim_idx, rotary_pos_emb=None, *args, **kwargs)``:
    ``batch_dim_idx=1`` means ``[s_local, batch, heads, head_dim]`` (Megatron-DeepSpeed's
    layout), ``0`` means ``[batch, s_local, heads, head_dim]``; k/v may have fewer heads.  Returns
    the local rows of the attention output in the input's layout.  ``rotary_pos_emb``
    (``(cos, sin)`` as DeepSpeed takes them, the sequence on dim 1) may cover the whole sequence
    (the local positions are picked out) or already only the local tokens.  Keyword arguments
    ``cu_seqlens`` (or ``cu_seq_lens_q``): global document boundaries of the packed row (batch 1);
    ``window_size`` / ``sliding_window``: a window for this call (else the module's).
    """

    def __init__(
        self,
        local_attention: torch.nn.Module | None,
        sequence_process_group: Any,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
        num_kv_heads: int | None = None,
        *,
        layout: str = "striped",
        causal: bool | None = None,
        softmax_scale: float | None = None,
        backend: str = "auto",
        window_size: tuple[int, int] | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx  # kept for compatibility; no all-to-all happens
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        self.num_kv_heads = num_kv_heads
        self.causal = bool(getattr(local_attention, "causal", True)) if causal is None else bool(causal)
        if softmax_scale is None:
            softmax_scale = getattr(local_attention, "softmax_scale", None)
        self.softmax_scale = softmax_scale
        dropout = getattr(local_attention, "dropout_p", 0.0) or 0.0
        if dropout > 0:
            warnings.warn(
                f"local_attention has dropout_p={dropout}; the ring engine applies no attention dropout",
                stacklevel=2,
            )
        self.window_size = None
        self.ulysses_groups = None  # (inner, outer): hierarchical CP, see configure()
        self.layout, self.backend = "striped", "auto"
        self.configure(layout=layout, backend=backend, window_size=window_size, sliding_window=sliding_window)

    def configure(self, layout: str | None = None, backend: str | None = None,
                  window_size: tuple[int, int] | None = None, sliding_window: int | None = None,
                  ulysses_groups=_KEEP) -> None:
        """Set the token layout, the kernel backend, the window and/or hierarchical CP
        (``initialize`` sets layout, backend and groups from the config).  ``window_size=(left,
        right)``: flash-attn convention, ``-1`` = unbounded; ``sliding_window=W``: transformers'
        convention, the same as ``(W - 1, 0)``; ``ulysses_groups``: ``(inner, outer)`` from
        :func:`striped_sp.ulysses_ring_groups` (Ulysses inside, the ring across)."""
        if ulysses_groups is not _KEEP:  # None: the plain ring
            self.ulysses_groups = ulysses_groups
        window = window_of(window_size, sliding_window, self.causal)
        if window is not None:
            self.window_size = window
        layout = self.layout if layout is None else ALGOS.get(layout, layout)
        backend = self.backend if backend is None else backend
        RingRequest(self.spg, layout=layout, backend=backend)  # ValueError for an unknown layout or backend
        self.layout, self.backend = layout, backend

    def _module_request(self) -> RingRequest:
        """The one request of this module (layout, causal, scale, backend, window, groups), built
        again only when one of those attributes changed; a forward derives a call's own documents
        or window from it and passes q, k, v."""
        key = (self.spg, self.layout, self.causal, self.softmax_scale, self.backend, self.window_size,
               self.ulysses_groups)
        cached = getattr(self, "_request", None)
        if cached is None or cached[0] != key:
            cached = self._request = (key, RingRequest(
                self.spg, layout=self.layout, causal=self.causal, softmax_scale=self.softmax_scale,
                backend=self.backend, window_size=self.window_size, ulysses_groups=self.ulysses_groups,
                sharded_by_documents=True))  # shard_batch shards by documents, maybe in a loader worker
        return cached[1]

    def extra_repr(self) -> str:
        window = "" if self.window_size is None else f", window_size={self.window_size}"
        return f"layout={self.layout!r}, causal={self.causal}, backend={self.backend!r}{window}"

    def _local_rotary(self, emb: torch.Tensor, local_len: int, seq_dim: int, cu_seqlens=None) -> torch.Tensor:
        # As DeepSpeed: permute(1, 0, 2, 3), after which the table broadcasts against q/k with
        # the sequence on q's sequence dim ([1, S, 1, d] for [s, b, h, d] inputs, [S, 1, 1, d]
        # for [b, s, h, d] inputs, as Megatron-DeepSpeed passes it).
        emb = emb.permute(1, 0, 2, 3)
        group = self.spg if self.spg is not None else dist.group.WORLD
        n = dist.get_world_size(group)
        if n > 1 and emb.size(seq_dim) == local_len * n:
            idx = device_positions(local_len * n, n, dist.get_rank(group), self.layout, cu_seqlens, emb.device)
            emb = emb.index_select(seq_dim, idx)
        elif emb.size(seq_dim) != local_len:
            raise ValueError(
                f"rotary_pos_emb covers {emb.size(seq_dim)} positions on the sequence dim: expected "
                f"the whole sequence ({local_len * n}) or the local tokens ({local_len})"
            )
        return emb

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int,
                rotary_pos_emb=None, *args: Any, **kwargs: Any) -> torch.Tensor:
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx={batch_dim_idx!r} must be 0 ([b, s, h, d]) or 1 ([s, b, h, d])")
        for name, t in (("query", query), ("key", key), ("value", value)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                raise ValueError(f"{name} must be a 4-dim tensor, got shape {tuple(getattr(t, 'shape', ()))}")
        seq_dim = 1 - batch_dim_idx
        cu_seqlens = batch_bounds(kwargs.get("cu_seqlens", kwargs.get("cu_seq_lens_q")))  # read once per batch
        window = window_of(kwargs.get("window_size"), kwargs.get("sliding_window"), self.causal)
        request = self._module_request()
        if window is not None and window != self.window_size:
            request = request.derive(window_size=window)
        if cu_seqlens is not None:
            request = request.derive(cu_seqlens=cu_seqlens)
        if rotary_pos_emb is not None:
            cos = self._local_rotary(rotary_pos_emb[0], query.size(seq_dim), seq_dim, cu_seqlens)
            sin = self._local_rotary(rotary_pos_emb[1], query.size(seq_dim), seq_dim, cu_seqlens)
            query, key = _apply_rotary(query, cos, sin), _apply_rotary(key, cos, sin)
        if batch_dim_idx == 1:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        out = request(query, key, value)
        return out.transpose(0, 1) if batch_dim_idx == 1 else out
