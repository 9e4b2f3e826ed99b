"""Rotary positions in a layout, and a CPU fallback for megatron-core's RoPE modules.

megatron-core computes the rotary table for the full sequence and keeps this CP rank's rows
with ``get_pos_emb_on_this_cp_rank`` (zigzag only, and through ``pin_memory``/``.cuda()``).
:func:`get_pos_emb_on_this_cp_rank` keeps the rows of ``striped_sp.positions`` instead, on the
table's own device.  :func:`cpu_fallback` wraps a RoPE method so that, when CUDA is absent,
its ``torch.cuda.current_device()`` calls resolve to the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

from ..layouts import positions
from .arguments import layout_of

__all__ = ["get_pos_emb_on_this_cp_rank", "cpu_fallback"]


def get_pos_emb_on_this_cp_rank(pos_emb: torch.Tensor, seq_dim: int, cp_group, *, algo: str = "striped"):
    """The rows of ``pos_emb`` (full sequence on ``seq_dim``) at this CP rank's positions.

    ``algo="native"`` keeps Megatron's zigzag rows, which equal the ``zigzag`` layout.
    """
    if cp_group is None:
        raise ValueError("cp_group must be given to select this CP rank's rotary positions")
    layout = "zigzag" if algo == "native" else layout_of(algo)
    size, rank = cp_group.size(), cp_group.rank()
    idx = positions(pos_emb.size(seq_dim), size, rank, layout).to(pos_emb.device)
    return pos_emb.index_select(seq_dim, idx)


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
