"""Mamba layers under a layout: megatron-core's Mamba context parallelism in the algo's token order.

megatron-core runs a Mamba layer at CP > 1 in three steps (``megatron/core/ssm/
mamba_context_parallel.py``): an all-to-all turns each rank's tokens into a share of the heads over
the whole sequence, the rows arriving in rank order (rank 0's local tokens, then rank 1's, ...);
``_undo_attention_load_balancing`` puts them in sequence order for the convolution and the scan;
``_redo_attention_load_balancing`` restores the rank order before the all-to-all back.  Megatron's
two functions know zigzag's order only (chunk arithmetic for dense rows, Transformer Engine's
``thd_get_partitioned_indices`` for packed THD rows).

Here both are one index permutation that the layout already gives: row ``p`` of the gathered
sequence is rank ``p // s_local``'s local token ``p % s_local``, at global position
``order[p]``, where ``order`` is every rank's :func:`~striped_sp.plan.layouts.positions` laid end
to end (for packed rows with the documents the batch was sliced by: :func:`.packed.keeps_padding`).
So every layout and stripe form runs, packed rows need no Transformer Engine, and zigzag's
permutation is Megatron's own.  The scan's document index (``seq_idx``) is megatron-core's: it
reads the global documents from ``PackedSeqParams`` after the undo step, in sequence order.

:func:`patch_context_parallel` installs the two functions in ``mamba_context_parallel``; gated
delta net imports megatron's by name, and :mod:`.gdn` puts the same two steps there.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from ..plan.layouts import get_layout, positions
from . import packed
from .arguments import layout_of

__all__ = ["gathered_order", "undo_load_balancing", "redo_load_balancing", "patch_context_parallel"]

_MODULE = "megatron.core.ssm.mamba_context_parallel"
_PERM_ATTR = "_striped_sp_mamba_order"


def gathered_order(seq_len: int, cp_size: int, layout: str, cu_seqlens=None) -> torch.Tensor:
    """int64 ``[seq_len]`` (CPU): the global position of each row of the all-to-all's output
    (every rank's tokens in ``layout``, rank 0's first).  ``cu_seqlens``: the bounds the batch was
    sliced by (``None``: a dense row, or a layout that does not place by documents)."""
    return torch.cat([positions(seq_len, cp_size, r, layout, cu_seqlens) for r in range(cp_size)])


class _Permute(torch.autograd.Function):
    """``x.index_select(0, index)`` whose backward is the inverse permutation's gather (no
    scatter-add: each row has exactly one source)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _orders(seq_len: int, cp_size: int, layout: str, cu_seqlens, device) -> tuple[torch.Tensor, torch.Tensor]:
    order = gathered_order(seq_len, cp_size, layout, cu_seqlens)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len, dtype=order.dtype)
    return order.to(device, non_blocking=True), inverse.to(device, non_blocking=True)


#: the algo's layout key, parsed once per algo rather than once per layer
_layout_of = functools.lru_cache(maxsize=16)(layout_of)


#: module-level because every Mamba layer of every batch of dense rows asks for the same two
#: permutations: built and copied to the device once per (length, CP size, layout, device)
@functools.lru_cache(maxsize=16)
def _dense_orders(seq_len: int, cp_size: int, layout: str, device) -> tuple[torch.Tensor, torch.Tensor]:
    get_layout(layout).check_seq_len(seq_len, cp_size)
    return _orders(seq_len, cp_size, layout, None, device)


def _permutations(input_: torch.Tensor, cp_size: int, packed_seq_params, algo: str):
    """``(order, inverse)`` on ``input_``'s device for a gathered ``[seq_len, b, ...]`` tensor.
    Packed rows keep theirs on the params object (one per batch, read by every Mamba layer)."""
    seq_len, layout = input_.size(0), _layout_of(algo)
    if packed_seq_params is None:
        return _dense_orders(seq_len, cp_size, layout, input_.device)
    key = (seq_len, cp_size, layout, input_.device)
    memo = getattr(packed_seq_params, _PERM_ATTR, None)
    if memo is not None and memo[0] == key:
        return memo[1]
    if input_.size(1) != 1:
        raise ValueError(f"a packed THD row reaches the Mamba layer as [t, {input_.size(1)}, ...]: "
                         "packed rows need --micro-batch-size 1")
    get_layout(layout).check_seq_len(seq_len, cp_size)
    cut = packed.documents_of(packed_seq_params, seq_len, layout) if packed.keeps_padding(layout) else None
    found = _orders(seq_len, cp_size, layout, cut, input_.device)
    try:
        setattr(packed_seq_params, _PERM_ATTR, (key, found))
    except (AttributeError, TypeError):  # a frozen params object: rebuilt next layer
        pass
    return found


def undo_load_balancing(input_: torch.Tensor, cp_size: int, packed_seq_params=None, *,
                        algo: str = "striped") -> torch.Tensor:
    """megatron-core's ``_undo_attention_load_balancing`` for ``algo``'s layout: ``input_``
    ``[seq_len, b, h_local]`` (the all-to-all's rows, rank order) -> the same rows in sequence
    order.  ``packed_seq_params``: the THD row's params (``b`` = 1), ``None`` for dense rows."""
    order, inverse = _permutations(input_, cp_size, packed_seq_params, algo)
    return _Permute.apply(input_, inverse, order)


def redo_load_balancing(input_: torch.Tensor, cp_size: int, packed_seq_params=None, *,
                        algo: str = "striped") -> torch.Tensor:
    """The inverse of :func:`undo_load_balancing`: sequence order -> the all-to-all's rank order."""
    order, inverse = _permutations(input_, cp_size, packed_seq_params, algo)
    return _Permute.apply(input_, order, inverse)


def _replacement(original: Callable, step: Callable, current_algo: Callable[[], Optional[str]]) -> Callable:
    """``original`` while no algo is installed, else ``step(..., algo=current_algo())`` (the same
    positional arguments; also :mod:`.gdn`'s packed-row permutation)."""

    @functools.wraps(original)
    def replaced(*args, **kwargs):
        algo = current_algo()
        if algo is None:
            return original(*args, **kwargs)
        return step(*args, **kwargs, algo=algo)

    replaced.__striped_sp_original__ = original
    return replaced


def patch_context_parallel(set_attr: Callable, current_algo: Callable[[], Optional[str]]) -> None:
    """Replace megatron-core's undo / redo steps of Mamba's context parallelism (where the module
    exists) by ones that follow ``current_algo()``'s layout; ``set_attr(owner, name, value)``
    records each replacement (the hooks' ``_set``, undone by ``uninstall``)."""
    import importlib

    try:
        module = importlib.import_module(_MODULE)
    except ImportError:
        return
    for name, step in (("_undo_attention_load_balancing", undo_load_balancing),
                       ("_redo_attention_load_balancing", redo_load_balancing)):
        original = getattr(module, name, None)
        if original is not None:
            set_attr(module, name, _replacement(original, step, current_algo))
