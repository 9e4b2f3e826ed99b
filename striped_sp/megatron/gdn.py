"""Gated delta net (``G``) layers under a layout: megatron-core's GDN context parallelism in the
algo's token order.

megatron-core (0.18 and later) runs a ``GatedDeltaNet`` layer at CP > 1 as it runs Mamba: the
input projection stays on the rank, an all-to-all (``tensor_a2a_cp2hp``) gives each rank a share
of the heads over the whole sequence, rows arriving in rank order, the sequence is put in order for
the convolution and the delta rule, and the inverse order and an all-to-all bring the output back
(``tensor_a2a_hp2cp``).  Megatron's order steps know zigzag's placement only:

* dense rows (0.18 and 0.19): ``tensor_a2a_cp2hp`` / ``tensor_a2a_hp2cp`` call the Mamba module's
  ``_undo_attention_load_balancing`` / ``_redo_attention_load_balancing``, imported by name into
  the GDN module (0.19: ``gated_delta_net/common.py``; 0.18: ``gated_delta_net.py``).  Both names
  are replaced there by :mod:`.mamba`'s steps, the layout's permutation;
* packed THD rows, 0.19: one sequence-dim permutation per layer, ``_build_thd_cp_a2a_perm(
  cu_seqlens, cp_size, t)`` (imported by name into ``gated_delta_net/gdn.py``), zigzag per
  document.  It is replaced by :func:`thd_permutation`: the same ``(idx, inv)`` pair built from the
  layout's positions (the documents the batch was sliced by where the layout places documents).
  megatron-core's check that every document's length divides by the CP size (zigzag's rule,
  ``_GDNBase._resolve_cu_seqlens``) is kept for ``zigzag`` and dropped for the layouts that do not
  need it (the plugin's batch slicing checks each layout's own rule);
* packed THD rows, 0.18: an all-to-all per document over each rank's contiguous share of it,
  which only zigzag's per-document placement gives: refused under any other layout, by name, at
  the first packed forward (:func:`_refuse_018_packed`).

Everything else (the convolution and the kernels with the global ``cu_seqlens``, the head split,
the output norm) is megatron-core's own.  The replacements follow ``current_algo()`` and fall
back to megatron-core's functions when no algo is installed.
"""

from __future__ import annotations

import functools
import importlib
from typing import Callable, Optional

import torch

from ..plan.layouts import get_layout
from . import mamba, packed
from .arguments import NATIVE_LAYOUT

__all__ = ["thd_permutation", "patch_context_parallel"]

#: modules holding megatron-core's undo / redo names for GDN (0.19: the package's common module;
#: 0.18: the single module)
_ORDER_MODULES = ("megatron.core.ssm.gated_delta_net.common", "megatron.core.ssm.gated_delta_net")
_THD_MODULE = "megatron.core.ssm.gated_delta_net.gdn"


@functools.lru_cache(maxsize=16)
def _packed_orders(bounds: Optional[tuple[int, ...]], seq_len: int, cp_size: int, layout: str, device):
    get_layout(layout).check_seq_len(seq_len, cp_size)
    return mamba._orders(seq_len, cp_size, layout, None if bounds is None else list(bounds), device)


def thd_permutation(cu_seqlens: torch.Tensor, cp_size: int, t_global: int, *,
                    algo: str = "striped") -> tuple[torch.Tensor, torch.Tensor]:
    """megatron-core 0.19's ``_build_thd_cp_a2a_perm`` for ``algo``'s layout: ``(idx, inv)`` with
    ``gathered.index_select(0, idx)`` the all-to-all's rows (rank order) in sequence order and
    ``natural.index_select(0, inv)`` the way back.  ``cu_seqlens``: the document bounds megatron-core
    resolved (padded where given), ``[-1] == t_global``.  Built once per (bounds, CP size, layout,
    device); the bounds are read to the host once per layer (megatron-core reads them there too)."""
    layout = mamba._layout_of(algo)
    bounds = (packed.thd_bounds(cu_seqlens, None, t_global, layout)
              if packed.keeps_padding(layout) else None)
    order, inverse = _packed_orders(None if bounds is None else tuple(bounds), t_global, cp_size, layout,
                                    cu_seqlens.device)
    # idx[p]: the gathered row at global position p (the inverse of order); inv[q]: row q's position
    return inverse, order


def _native_placement(algo: str) -> bool:
    return mamba._layout_of(algo) == get_layout(NATIVE_LAYOUT).key


def _resolve_replacement(original: Callable, current_algo: Callable[[], Optional[str]]) -> Callable:
    """``_resolve_cu_seqlens`` without zigzag's "every document divides by the CP size" rule under
    a layout that does not need it (megatron-core's other checks kept)."""

    @functools.wraps(original)
    def replaced(self, cu_seqlens_padded, cu_seqlens_actual, total_seq_len, name, cp_size: int = 1):
        algo = current_algo()
        if algo is not None and not _native_placement(algo):
            cp_size = 1
        return original(self, cu_seqlens_padded, cu_seqlens_actual, total_seq_len, name, cp_size=cp_size)

    replaced.__striped_sp_original__ = original
    return replaced


def _refuse_018_packed(original: Callable, current_algo: Callable[[], Optional[str]]) -> Callable:
    """megatron-core 0.18's ``_unpack_sequence`` (its packed GDN path only): refused under a layout
    other than zigzag's placement, whose per-document chunks that path assumes."""

    @functools.wraps(original)
    def replaced(x, cu_seqlens, dim=1):
        algo = current_algo()
        if algo is not None and not _native_placement(algo):
            raise ValueError(
                f"--context-parallel-algo {algo}: megatron-core 0.18's gated delta net ('G') context "
                "parallelism for packed (THD) rows exchanges each document's contiguous per-rank chunks, "
                "which only zigzag's placement gives; use megatron-core 0.19 (whose packed GDN path "
                "striped_sp follows), dense rows, or --context-parallel-algo zigzag")
        return original(x, cu_seqlens, dim)

    replaced.__striped_sp_original__ = original
    return replaced


def patch_context_parallel(set_attr: Callable, current_algo: Callable[[], Optional[str]]) -> None:
    """Replace megatron-core's GDN order steps (where they exist) by ones that follow
    ``current_algo()``'s layout; ``set_attr(owner, name, value)`` records each replacement."""
    for module_name in _ORDER_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        for name, step in (("_undo_attention_load_balancing", mamba.undo_load_balancing),
                           ("_redo_attention_load_balancing", mamba.redo_load_balancing)):
            original = module.__dict__.get(name)
            if original is not None:
                set_attr(module, name, mamba._replacement(original, step, current_algo))
        base = module.__dict__.get("_GDNBase") or module.__dict__.get("GatedDeltaNet")
        resolve = None if base is None else base.__dict__.get("_resolve_cu_seqlens")
        if resolve is not None:
            set_attr(base, "_resolve_cu_seqlens", _resolve_replacement(resolve, current_algo))
        unpack = module.__dict__.get("_unpack_sequence")
        if unpack is not None:
            set_attr(module, "_unpack_sequence", _refuse_018_packed(unpack, current_algo))
    try:
        thd = importlib.import_module(_THD_MODULE)
    except ImportError:
        return
    original = thd.__dict__.get("_build_thd_cp_a2a_perm")
    if original is not None:
        set_attr(thd, "_build_thd_cp_a2a_perm", mamba._replacement(original, thd_permutation, current_algo))
