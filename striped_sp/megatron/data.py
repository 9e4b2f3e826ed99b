"""The data path in a layout: batch slicing for a CP rank, and MTP's sequence roll.

Megatron's loader gives every CP rank the full sequence; :func:`get_batch_on_this_cp_rank`
keeps this rank's tokens in the algo's layout (labels were shifted on the full sequence, so
no target is lost at shard edges).  :func:`roll_tensor` is the layout-aware counterpart of
megatron-core's ``multi_token_prediction.roll_tensor`` (shift along the *global* sequence).
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ..layouts import shard, unshard
from .arguments import check_algo, layout_of

__all__ = ["get_batch_on_this_cp_rank", "roll_tensor", "cp_size_and_rank"]


def cp_size_and_rank(cp_group=None) -> tuple[int, int]:
    """(size, rank) of ``cp_group``, or of Megatron's context-parallel group when ``None``."""
    if cp_group is not None:
        return dist.get_world_size(cp_group), dist.get_rank(cp_group)
    try:
        from megatron.core import parallel_state
    except ImportError:  # pragma: no cover - megatron is an optional extra
        raise ValueError(
            "cp_group=None needs megatron-core's parallel_state (pip install 'striped_sp[megatron]'); "
            "or pass cp_group="
        ) from None
    if not parallel_state.model_parallel_is_initialized():
        raise ValueError(
            "cp_group=None but Megatron's model parallel state is not initialized: call "
            "parallel_state.initialize_model_parallel(...) or pass cp_group="
        )
    return (
        parallel_state.get_context_parallel_world_size(),
        parallel_state.get_context_parallel_rank(),
    )


def _megatron_original(module_name: str, attr: str):
    import importlib

    fn = getattr(importlib.import_module(module_name), attr)
    return getattr(fn, "__striped_sp_original__", fn)


def get_batch_on_this_cp_rank(
    batch: Dict[str, Any], algo: str = "striped", cp_group: Optional[dist.ProcessGroup] = None
) -> Dict[str, Any]:
    """This CP rank's part of ``batch`` in ``algo``'s layout.

    Tensors are sliced along dim 1 (``tokens``, ``labels``, ``loss_mask``, ``position_ids``: ``[b, s]``)
    or, for ``attention_mask`` (``[b, 1, s, s]``), along dim 2 (its query rows).  ``None`` and
    non-tensor values pass through.  Returns a new dict in the same key order.  ``algo="native"``
    calls megatron-core's own slicing.  Every length is checked before anything is sliced.
    """
    check_algo(algo)
    if algo == "native":
        fn = _megatron_original("megatron.core.utils", "get_batch_on_this_cp_rank")
        return fn(batch, cp_group=cp_group)
    layout = layout_of(algo)
    size, rank = cp_size_and_rank(cp_group)
    if size == 1:
        return dict(batch)
    dims = {}
    for key, val in batch.items():
        if not isinstance(val, torch.Tensor):
            continue
        dim = 2 if key == "attention_mask" else 1
        if val.dim() <= dim:
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(val.shape)}: expected a sequence dim {dim}"
            )
        dims[key] = dim
    if dims:
        lens = {k: batch[k].size(d) for k, d in dims.items()}
        if len(set(lens.values())) != 1:
            raise ValueError(f"batch tensors disagree on the sequence length: {lens}")
        from ..layouts import get_layout

        get_layout(layout).check_seq_len(next(iter(lens.values())), size)
    return {
        key: shard(val, size, rank, dim=dims[key], layout=layout) if key in dims else val
        for key, val in batch.items()
    }


def roll_tensor(
    tensor: torch.Tensor,
    shifts: int = -1,
    dims: int = -1,
    cp_group: Optional[dist.ProcessGroup] = None,
    packed_seq_params=None,
    *,
    algo: str = "striped",
):
    """Roll the sharded ``tensor`` along the global sequence; return ``(rolled, rolled.sum())``.

    The local result equals rolling the full sequence by ``shifts`` (emptied slots set to 0)
    and sharding it in ``algo``'s layout: what MTP needs for ``input_ids``, ``position_ids``,
    ``labels`` and ``loss_mask``.  With CP size 1 or no group it is a plain roll.  The rolled
    tensors carry no gradient (they are token ids and masks).  ``algo="native"`` calls
    megatron-core's own roll.
    """
    check_algo(algo)
    if algo == "native":
        fn = _megatron_original("megatron.core.transformer.multi_token_prediction", "roll_tensor")
        return fn(tensor, shifts=shifts, dims=dims, cp_group=cp_group, packed_seq_params=packed_seq_params)
    if packed_seq_params is not None:
        raise ValueError(
            f"--context-parallel-algo {algo} does not support packed THD sequences yet: "
            "drop sequence packing (--sft) or use --context-parallel-algo native"
        )
    dim = dims % tensor.dim()
    size = 1 if cp_group is None else dist.get_world_size(cp_group)
    if size == 1:
        full = tensor
    else:
        layout = layout_of(algo)
        local = tensor.detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=cp_group)
        full = unshard(parts, dim=dim, layout=layout)
    seq = full.size(dim)
    if abs(shifts) >= seq:
        rolled = torch.zeros_like(full)
    else:
        rolled = torch.roll(full, shifts=shifts, dims=dim)
        if shifts < 0:
            rolled.narrow(dim, seq + shifts, -shifts).zero_()
        elif shifts > 0:
            rolled.narrow(dim, 0, shifts).zero_()
    if size > 1:
        rolled = shard(rolled, size, dist.get_rank(cp_group), dim=dim, layout=layout)
    return rolled, rolled.sum()
