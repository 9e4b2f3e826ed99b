"""The data path in a layout: batch slicing for a CP rank, and MTP's sequence roll.

Megatron's loader gives every CP rank the full sequence; :func:`get_batch_on_this_cp_rank`
keeps this rank's tokens in the algo's layout (labels were shifted on the full sequence, so
no target is lost at shard edges), and :func:`get_thd_batch_on_this_cp_rank` does the same for
packed THD rows.  An ``attention_mask`` (``--reset-attention-mask``) is read for its documents,
which travel with the sliced mask to the ring.  :func:`roll_tensor` is the layout-aware
counterpart of megatron-core's ``multi_token_prediction.roll_tensor`` (shift along the *global*
sequence, inside each document of a packed row).
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from ..engine.request import prepare_plans
from ..plan.layouts import get_layout, shard, unshard
from . import packed
from .arguments import check_algo, layout_of, rows_layout

__all__ = ["get_batch_on_this_cp_rank", "get_thd_batch_on_this_cp_rank", "roll_tensor", "cp_size_and_rank"]

#: batch entries that are not [b, s] token tensors (attention_mask first: sliced on its rows)
_THD_SKIP = ("attention_mask", "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "local_cp_size")


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
    or, for ``attention_mask`` (``[b, 1, s, s]``), along dim 2 (its query rows).  The mask must be
    causal inside documents (``--reset-attention-mask``); its documents are attached to the sliced
    mask for the ring (:mod:`.packed`).  ``None`` and non-tensor values pass through.  Returns a new dict in the same key order.  ``algo="native"``
    calls megatron-core's own slicing.  Every length is checked before anything is sliced.
    """
    check_algo(algo)
    if algo == "native":
        fn = _megatron_original("megatron.core.utils", "get_batch_on_this_cp_rank")
        if "is_hybrid_cp" in inspect.signature(fn).parameters:  # megatron-core >= 0.18
            return fn(batch, is_hybrid_cp=False, cp_group=cp_group)
        return fn(batch, cp_group=cp_group)
    if isinstance(batch.get("cu_seqlens"), torch.Tensor):  # megatron-core >= 0.18: a packed row
        out, _ = get_thd_batch_on_this_cp_rank(batch, batch["cu_seqlens"], batch.get("cu_seqlens_padded"),
                                               batch.get("max_seqlen"), algo=algo, cp_group=cp_group)
        return out
    size, rank = cp_size_and_rank(cp_group)
    seqs = {val.size(2 if key == "attention_mask" else 1) for key, val in batch.items()
            if isinstance(val, torch.Tensor) and key not in _THD_SKIP[1:] and val.dim() > (2 if key == "attention_mask" else 1)}
    # [b, s] rows: documents never placed; the default's order by the row length (arguments.rows_layout)
    layout = rows_layout(layout_of(algo), *((next(iter(seqs)), size) if len(seqs) == 1 else ()))
    mask = batch.get("attention_mask")
    documents = packed.documents_from_mask(mask) if isinstance(mask, torch.Tensor) else None
    if size == 1:
        out = dict(batch)
        if documents is not None:
            packed.attach(mask, documents)
        return out
    dims = {}
    for key, val in batch.items():
        if not isinstance(val, torch.Tensor) or key in _THD_SKIP[1:]:
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
        get_layout(layout).check_seq_len(next(iter(lens.values())), size)
    if documents is not None and packed.keeps_padding(layout) and any(len(b) > 2 for b in documents):
        multiple = get_layout(layout).document_multiple(size)
        if multiple == 1:  # documents of any length: a striped doc_placement or per-document stripes
            raise ValueError(
                f"--context-parallel-algo {algo}: --striped-doc-placement and --striped-stripe-size doc place "
                "the documents of packed THD rows (--sft) only, not those of --reset-attention-mask [b, s] "
                "batches (Megatron's RoPE takes one table for every row): use --striped-doc-placement split "
                "and an integer stripe size")
        raise ValueError(
            f"--context-parallel-algo {algo} cuts each packed document into chunks (every document a multiple "
            f"of {multiple} tokens) and cannot run the documents of --reset-attention-mask inside whole rows: "
            "use --context-parallel-algo striped (balanced on documents) or ring")
    out = {
        key: shard(val, size, rank, dim=dims[key], layout=layout) if key in dims else val
        for key, val in batch.items()
    }
    if documents is not None:
        packed.attach(out["attention_mask"], documents)
    return out


def get_thd_batch_on_this_cp_rank(
    batch: Dict[str, Any],
    cu_seqlens: torch.Tensor,
    cu_seqlens_padded: Optional[torch.Tensor],
    max_seqlen,
    cp_size: Optional[int] = None,
    cp_rank: Optional[int] = None,
    *,
    algo: str = "striped",
    cp_group: Optional[dist.ProcessGroup] = None,
):
    """This CP rank's part of a packed THD row, and its ``PackedSeqParams``.

    The arguments are megatron-core's ``get_thd_batch_on_this_cp_rank``'s: ``batch`` holds
    ``[1, t]`` tensors of the whole buffer; ``cu_seqlens`` ``[n]`` or ``[1, n]`` int32 real
    document boundaries, ``cu_seqlens_padded`` where each document sits in the buffer (``None``:
    no padding), ``max_seqlen`` the longest document (an int or a tensor).  Every ``[1, t]``
    tensor is sliced on dim 1 in ``algo``'s layout (``zigzag``: per document, as Transformer
    Engine does; a striped layout key with ``place=``: by the documents, each padded one whole).  Returns ``(batch, packed_seq_params)``; the params carry the ring's bounds
    and, from megatron-core 0.19, the row's ``total_tokens`` (from which megatron-core builds the
    document index ``seq_idx`` of its Mamba layers, as in its own packed Mamba training).
    """
    check_algo(algo)
    if algo == "native":
        fn = _megatron_original("megatron.core.utils", "get_thd_batch_on_this_cp_rank")
        return fn(batch, cu_seqlens, cu_seqlens_padded, max_seqlen, cp_size=cp_size, cp_rank=cp_rank)
    from megatron.core.packed_seq_params import PackedSeqParams

    layout = layout_of(algo)
    if cp_size is None or cp_rank is None:
        cp_size, cp_rank = cp_size_and_rank(cp_group)
    cu = cu_seqlens.reshape(-1) if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens
    pad = cu_seqlens_padded.reshape(-1) if isinstance(cu_seqlens_padded, torch.Tensor) else cu_seqlens_padded
    if isinstance(max_seqlen, torch.Tensor):
        max_seqlen = int(max_seqlen.reshape(-1)[0].item())
    elif max_seqlen is None and isinstance(pad if pad is not None else cu, torch.Tensor):
        edges = pad if pad is not None else cu
        max_seqlen = int((edges[1:] - edges[:-1]).max())
    seq_len = packed.batch_seq_len(batch)
    # megatron-core >= 0.19 builds Mamba's document index (seq_idx) from the row's total_tokens
    fields = getattr(PackedSeqParams, "__dataclass_fields__", ())
    mamba = {"total_tokens": seq_len} if "total_tokens" in fields else {}
    params = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=pad,
        cu_seqlens_kv_padded=pad, max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen, **mamba,
    )
    if cp_group is not None and hasattr(params, "cp_group"):
        params.cp_group = cp_group
    lay = get_layout(layout)
    lay.check_seq_len(seq_len, cp_size)
    bounds = packed.documents_of(params, seq_len, layout)
    # zigzag and a striped doc_placement place tokens by the documents; the others ignore them
    from ..plan.masks import check_cu_seqlens

    check_cu_seqlens(bounds, seq_len, cp_size, lay)
    if cp_size > 1 and len(bounds) > 2:  # the batch's plan, ready for its first layer
        prepare_plans(seq_len, world_size=cp_size, rank=cp_rank, layout=layout, cu_seqlens=bounds)
    for key, val in batch.items():
        if key in _THD_SKIP or not isinstance(val, torch.Tensor):
            continue
        if val.dim() < 2 or val.size(1) != seq_len:
            raise ValueError(f"batch[{key!r}] has shape {tuple(val.shape)}: expected [1, {seq_len}, ...]")
    out = dict(batch)
    if cp_size > 1:
        cut = bounds if packed.keeps_padding(layout) else None
        for key, val in batch.items():
            if key not in _THD_SKIP and isinstance(val, torch.Tensor):
                out[key] = shard(val, cp_size, cp_rank, dim=1, layout=layout, cu_seqlens=cut)
    return out, params


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
    dim = dims % tensor.dim()
    size = 1 if cp_group is None else dist.get_world_size(cp_group)
    seq = tensor.size(dim) * size
    # [b, s] rows: as the batch slicing placed them (arguments.rows_layout); packed rows by their documents
    layout = layout_of(algo) if packed_seq_params is not None else rows_layout(layout_of(algo), seq, size)
    bounds = cut = None
    if packed_seq_params is not None:
        # roll inside each document's real tokens (padding apart); zigzag shards by padded documents
        bounds = packed.documents_of(packed_seq_params, seq, None)  # the real tokens' documents
        cut = packed.documents_of(packed_seq_params, seq, layout) if packed.keeps_padding(layout) else None
    if size == 1:
        full = tensor
    else:
        local = tensor.detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local, group=cp_group)
        full = unshard(parts, dim=dim, layout=layout, cu_seqlens=cut)
    rolled = _roll_within(full, shifts, dim, bounds)
    if size > 1:
        rolled = shard(rolled, size, dist.get_rank(cp_group), dim=dim, layout=layout, cu_seqlens=cut)
    return rolled, rolled.sum()


def _roll_within(full: torch.Tensor, shifts: int, dim: int, bounds) -> torch.Tensor:
    """``full`` rolled by ``shifts`` on ``dim``; slots whose source lies outside the row (or, with
    ``bounds``, outside their own document) are 0."""
    seq = full.size(dim)
    pos = torch.arange(seq, device=full.device)
    src = pos - shifts
    valid = (src >= 0) & (src < seq)
    if bounds is not None:
        edges = torch.tensor(bounds[1:-1], dtype=torch.int64, device=full.device)
        doc = torch.bucketize(pos, edges, right=True)
        valid &= doc == torch.bucketize(src.clamp(0, seq - 1), edges, right=True)
    shape = [1] * full.dim()
    shape[dim] = seq
    picked = full.index_select(dim, src.clamp(0, seq - 1))
    return torch.where(valid.view(shape), picked, torch.zeros((), dtype=full.dtype, device=full.device))
