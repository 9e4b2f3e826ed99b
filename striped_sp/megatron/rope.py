"""Rotary positions in a layout, and a CPU fallback for megatron-core's RoPE modules.

megatron-core computes the rotary table for the full sequence and keeps this CP rank's rows
with ``get_pos_emb_on_this_cp_rank`` (zigzag only, and through ``pin_memory``/``.cuda()``).
:func:`get_pos_emb_on_this_cp_rank` keeps the rows of ``striped_sp.positions`` instead, on the
table's own device.  :func:`cpu_fallback` wraps a RoPE method so that, when CUDA is absent,
its ``torch.cuda.current_device()`` calls resolve to the CPU.  :func:`apply_rotary_pos_emb_thd`
replaces Megatron's THD RoPE (which assumes zigzag chunks of every document): each local token of
a packed row gets the rotary row of its position inside its document, on the unfused and on the
fused (Transformer Engine) path.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import weakref

import torch

from ..plan.layouts import positions
from ..plan.packing import document_positions
from .arguments import NATIVE_LAYOUT, layout_of, rows_layout

__all__ = ["get_pos_emb_on_this_cp_rank", "apply_rotary_pos_emb_thd", "cpu_fallback"]


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group, *, algo: str = "striped"):
    """The rows of ``pos_emb`` (full sequence on ``seq_dim``) at this CP rank's positions.

    ``algo="native"`` keeps Megatron's zigzag rows, which equal the ``zigzag`` layout.
    """
    if cp_group is None:
        raise ValueError("cp_group must be given to select this CP rank's rotary positions")
    size, rank = cp_group.size(), cp_group.rank()
    # [b, s] rows: the layout the batch slicing placed them by (arguments.rows_layout)
    layout = NATIVE_LAYOUT if algo == "native" else rows_layout(layout_of(algo), pos_emb.size(seq_dim), size)
    idx = positions(pos_emb.size(seq_dim), size, rank, layout).to(pos_emb.device)
    return pos_emb.index_select(seq_dim, idx)


# module-level: Megatron calls RoPE once per layer and keeps nothing per batch for us; keyed by the
# batch's cu_seqlens object (weakly) and the layout, at most 65 entries: one device read per batch
_POSITIONS: dict = {}


def _thd_positions(cu_seqlens, seq_len: int, size: int, rank: int, layout: str, table_rows: int, device):
    """Rotary positions of this rank's tokens of a packed row: inside their document, or global
    when the table has one row per token of the buffer (Megatron's rule).  Cached by the
    boundary tensor (the same object in every layer), so the GPU is read once per batch."""
    from .packed import boundary_ints, thd_bounds

    key = (id(cu_seqlens), seq_len, size, rank, layout, table_rows, device)
    hit = _POSITIONS.get(key)
    if hit is not None and hit[0]() is cu_seqlens:
        return hit[1]
    given = boundary_ints(cu_seqlens)
    bounds = thd_bounds(given, None, seq_len, layout)  # the padded bounds: the buffer's documents, padding inside
    if table_rows == given[-1]:
        pos = positions(seq_len, size, rank, layout, bounds)
    else:
        pos = document_positions(seq_len, size, rank, layout, bounds)
    if pos.numel() and int(pos.max()) >= table_rows:
        raise ValueError(f"a packed document reaches position {int(pos.max())} but the rotary table has "
                         f"{table_rows} rows: max_seqlen of the packed batch is too small")
    pos = pos.to(device)  # once per batch, not per layer
    if isinstance(cu_seqlens, torch.Tensor):
        if len(_POSITIONS) > 64:
            _POSITIONS.clear()
        _POSITIONS[key] = (weakref.ref(cu_seqlens), pos)
    return pos


def apply_rotary_pos_emb_thd(t: torch.Tensor, cu_seqlens, freqs: torch.Tensor, config, cp_group=None,
                             mscale: float = 1.0, *, algo: str = "striped") -> torch.Tensor:
    """RoPE on this rank's tokens of a packed row, in ``algo``'s layout.

    ``t``: ``[t_local, heads, d]``; ``cu_seqlens``: the boundaries of the row as Megatron's
    attention passes them (the padded ones when there is padding); ``freqs``: ``[max_s, 1, 1,
    rot_dim]`` float rotary angles from position 0 (or one row per token of the whole buffer,
    then the global positions are used, as Megatron does).  Returns ``t``'s shape and dtype.
    """
    from megatron.core.models.common.embeddings import rope_utils

    size = 1 if cp_group is None else cp_group.size()
    rank = 0 if cp_group is None else cp_group.rank()
    layout = NATIVE_LAYOUT if algo == "native" else layout_of(algo)
    seq_len = t.size(0) * size
    pos = _thd_positions(cu_seqlens, seq_len, size, rank, layout, freqs.size(0), freqs.device)
    rows = freqs.index_select(0, pos)  # [t_local, 1, 1, rot_dim]
    fused = getattr(rope_utils, "fused_apply_rotary_pos_emb", None)
    if getattr(config, "apply_rope_fusion", False) and fused is not None and mscale == 1.0:
        return fused(t.unsqueeze(1), rows, interleaved=config.rotary_interleaved).squeeze(1)
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1), rows, rotary_interleaved=config.rotary_interleaved,
        multi_latent_attention=config.multi_latent_attention, mscale=mscale,
    ).squeeze(1)


_LOCK = threading.RLock()


@contextlib.contextmanager
def _current_device_is_cpu():
    with _LOCK:
        saved = torch.cuda.current_device
        torch.cuda.current_device = lambda: "cpu"
        try:
            yield
        finally:
            torch.cuda.current_device = saved


def cpu_fallback(fn):
    """Wrap ``fn`` so that, without CUDA, ``torch.cuda.current_device()`` inside it means CPU."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if torch.cuda.is_available():
            return fn(*args, **kwargs)
        with _current_device_is_cpu():
            return fn(*args, **kwargs)

    wrapper.__striped_sp_original__ = fn
    return wrapper
