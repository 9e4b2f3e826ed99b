"""Data path: shift labels on the full sequence, then shard every sequence tensor by the layout.

Every rank of a sequence-parallel group loads the *same* full micro-batch (as Megatron does); each
keeps its own tokens.  Labels are shifted before sharding, so the target of every token travels
with that token and none is lost at shard edges.  No communication happens here: documents and
padding are read from the full batch, so every rank derives the same boundaries.

A batch is a dict of ``[batch, seq, ...]`` tensors (``input_ids`` required).  Three kinds:

* **plain rows** (no documents, no padding): every ``[batch, seq, ...]`` tensor is sharded by the
  layout; ``position_ids`` are the global positions of the local tokens (from the batch if it has
  them, else ``0..S-1``);
* **padded rows** (``attention_mask`` ones then zeros, as ordinary padded collators make them):
  as plain rows, with the padding's targets ``ignore_index``.  The padding sits after every real
  token of its row, so under causal attention no real token sees it.  When the row length does not
  fit the layout, every row gets more padding at its end (``input_ids`` 0);
* **packed rows** (``position_ids`` restarting at 0 per document, or ``cu_seq_lens_q/k``, as
  ``DataCollatorWithFlattening`` makes them): see :mod:`.packed`.  The real tokens of all rows
  become one row (batch 1), padded for the layout; labels are shifted inside each document;
  ``position_ids`` restart at 0 per document; ``cu_seq_lens_q/k`` (int32) hold the boundaries of
  the *global* padded row, for the attention; ``max_length_q/k`` its longest document.

In every kind the sharded batch also has:

* ``shift_labels``: the local tokens' targets (``ignore_index`` where there is none);
  ``labels`` holds the same tensor, so that Hugging Face models compute their loss (their loss
  uses ``shift_labels`` as given and does not shift again);
* ``num_items_in_batch``: the number of targets that count in the *whole* micro-batch, so a
  rank's summed local loss divided by it is its exact share of the global mean loss.

``attention_mask`` is never passed on.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from ..engine.agreement import gather_rows, per_call_checks_enabled
from ..engine.request import prepare_plans
from ..plan.layouts import get_layout, positions
from .packed import CU_KEYS, MAX_KEYS, find_documents, pack_rows

__all__ = ["shard_batch", "ShardedDataLoader", "ShardingCollator", "IGNORE_INDEX", "check_same_batch"]

IGNORE_INDEX = -100


def _shift_left(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    pad = torch.full_like(labels[:, :1], ignore_index)
    return torch.cat([labels[:, 1:], pad], dim=1)


def _check_batch(batch: Mapping[str, Any]) -> tuple[int, int]:
    if not isinstance(batch, Mapping):
        raise ValueError(f"a batch must be a dict of tensors, got {type(batch).__name__}")
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("a batch needs 'input_ids', a [batch, seq] tensor")
    seq_len = ids.size(1)
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and key in ("labels", "shift_labels", "position_ids", "attention_mask"):
            if value.dim() < 2 or value.size(1) != seq_len:
                raise ValueError(
                    f"batch[{key!r}] has shape {tuple(value.shape)}: dim 1 must be the sequence "
                    f"({seq_len} tokens, as input_ids)"
                )
    return ids.size(0), seq_len


def _per_token(value, seq_len: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == seq_len


def _extend_rows(batch: dict, seq_len: int, extra: int, ignore_index: int) -> dict:
    """Append ``extra`` padding tokens to every row (targets ``ignore_index``, positions counting on)."""
    out = {}
    for key, value in batch.items():
        if not _per_token(value, seq_len):
            out[key] = value
            continue
        if key == "position_ids":
            tail = value[:, -1:] + torch.arange(1, extra + 1, device=value.device)
        else:
            fill = ignore_index if key in ("labels", "shift_labels") else 0
            tail = torch.full((value.size(0), extra, *value.shape[2:]), fill, dtype=value.dtype, device=value.device)
        out[key] = torch.cat([value, tail], dim=1)
    return out


def _plain_rows(batch: Mapping[str, Any], valid, world_size: int, layout: str, ignore_index: int) -> dict:
    """Plain or right-padded rows, with shifted labels, extended to fit the layout if padded."""
    ids = batch["input_ids"]
    b, seq_len = ids.shape
    out = {k: v for k, v in batch.items() if k not in ("attention_mask", *CU_KEYS, *MAX_KEYS)}
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(seq_len, device=ids.device).unsqueeze(0).expand_as(ids)
    elif out["position_ids"].size(0) != b:
        out["position_ids"] = out["position_ids"].expand(b, -1)
    if "shift_labels" in out:
        shifted = out["shift_labels"]
    elif "labels" in out:
        shifted = _shift_left(out["labels"], ignore_index)
    else:
        shifted = None
    padded = "attention_mask" in batch
    if shifted is not None and any(v < seq_len for v in valid):
        no_target = torch.arange(seq_len, device=ids.device).unsqueeze(0) >= torch.tensor(valid, device=ids.device).unsqueeze(1) - 1
        shifted = shifted.masked_fill(no_target, ignore_index)  # the last real token and the padding
    if shifted is not None:
        out["shift_labels"] = shifted
        out.pop("labels", None)
    unit = world_size * get_layout(layout).seq_multiple
    if padded and seq_len % unit:
        out = _extend_rows(out, seq_len, -seq_len % unit, ignore_index)
    return out


def _check_fit(seq_len: int, world_size: int, layout: str) -> None:
    try:
        get_layout(layout).check_seq_len(seq_len, world_size)
    except ValueError as err:
        raise ValueError(f"batch['input_ids'] has {seq_len} tokens: {err}; pass an attention_mask (padded "
                         "rows are extended to fit) or pad the rows to a multiple yourself") from None


def shard_batch(
    batch: Mapping[str, Any],
    world_size: int,
    rank: int,
    layout: str = "striped",
    ignore_index: int = IGNORE_INDEX,
) -> dict:
    """This rank's part of a full micro-batch ``batch`` (see the module notes for the kinds and keys).

    If the batch already has ``shift_labels`` they are taken as the shifted targets (still
    ``ignore_index`` on padding and at document ends); else ``labels`` are shifted here.  Raises
    ``ValueError`` naming the key when the sequence length of plain rows does not fit the layout,
    a sequence tensor has another length, the ``attention_mask`` is not right padding, or the
    ``position_ids`` / ``cu_seq_lens_q/k`` describe no consistent documents."""
    b, seq_len = _check_batch(batch)
    get_layout(layout)
    docs = find_documents(batch, b, seq_len)
    bounds = None
    if docs.packed:
        out, padded = pack_rows(batch, docs, world_size, layout, ignore_index)
        bounds = padded.cu_seqlens
        seq_len = padded.seq_len
        # the batch's plan, ready for its first layer; not in a loader worker process, whose plan
        # cache the model never sees (the first layer builds it there instead of twice)
        if world_size > 1 and torch.utils.data.get_worker_info() is None:
            prepare_plans(seq_len, world_size=world_size, rank=rank, layout=layout, cu_seqlens=bounds)
    else:
        out = _plain_rows(batch, docs.valid, world_size, layout, ignore_index)
        seq_len = out["input_ids"].size(1)
        _check_fit(seq_len, world_size, layout)
    shifted = out.get("shift_labels")
    if shifted is not None:
        out["num_items_in_batch"] = (shifted != ignore_index).sum()
    idx = positions(seq_len, world_size, rank, layout, bounds).to(out["input_ids"].device)
    for key, value in out.items():
        if _per_token(value, seq_len):
            out[key] = value.index_select(1, idx)
    if shifted is not None:
        out["labels"] = out["shift_labels"]
    return out


def _digest(batch: Mapping[str, Any]) -> list[int]:
    """Shape and checksums of the tensors that decide tokens and documents (equal batches, equal digests)."""
    out = list(batch["input_ids"].shape)
    for key in ("input_ids", "position_ids", "attention_mask", "cu_seq_lens_q", "labels"):
        value = batch.get(key)
        if not isinstance(value, torch.Tensor):
            out.append(-1)
            continue
        flat = value.detach().flatten().long().cpu()
        out.append(int((flat * (torch.arange(flat.numel()) % 1000003 + 1)).sum()) % (1 << 61))
    return out


def check_same_batch(batch: Mapping[str, Any], group) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless all hold the same full micro-batch
    (one small all-gather of shapes and checksums, :func:`striped_sp.engine.agreement.gather_rows`)."""
    rows = gather_rows(group, _digest(batch), what="check_same_batch")
    if any(row != rows[0] for row in rows):
        differ = [r for r, row in enumerate(rows) if row != rows[0]]
        raise ValueError(
            f"the ranks of the sequence-parallel group loaded different micro-batches (ranks {differ} differ "
            "from rank 0 in input_ids, position_ids, attention_mask, cu_seq_lens_q or labels): every rank "
            "of a group must load the same full micro-batch (shard_batch then keeps its own tokens)")


class ShardingCollator:
    """``collate_fn`` then :func:`shard_batch`: a collate function that yields this rank's part.

    For loaders that frameworks rebuild from their parts (accelerate's ``skip_first_batches`` on
    resume copies ``dataset``, ``sampler`` and ``collate_fn``), where a wrapper around the loader would
    be lost.  Picklable (``world_size`` and ``rank`` are ints), so it runs in loader worker processes;
    it sends no message (use :class:`ShardedDataLoader` for the cross-rank batch check).
    ``collate_fn=None``: torch's default collation."""

    def __init__(self, collate_fn, world_size: int, rank: int, layout: str = "striped",
                 ignore_index: int = IGNORE_INDEX):
        get_layout(layout)
        self.collate_fn = collate_fn
        self.world_size, self.rank, self.layout, self.ignore_index = world_size, rank, layout, ignore_index

    def __call__(self, samples):
        if self.collate_fn is None:
            from torch.utils.data import default_collate

            batch = default_collate(samples)
        else:
            batch = self.collate_fn(samples)
        return shard_batch(batch, self.world_size, self.rank, self.layout, self.ignore_index)


class ShardedDataLoader:
    """Wraps a loader of full micro-batches; yields this rank's :func:`shard_batch` of each.

    ``group``: the sequence-parallel group (``None``: one rank, which still gets shifted labels and
    ``num_items_in_batch``).  Every rank of the group must see the same batches; ``check_ranks``
    (default: on when ``STRIPED_SP_CHECK_RANKS`` is ``1`` or ``always`` in the environment, off when
    unset or ``0``; other values are a ``ValueError``) checks that on every batch with one small
    all-gather (:func:`check_same_batch`).
    """

    def __init__(self, loader: Iterable, group=None, layout: str = "striped", ignore_index: int = IGNORE_INDEX,
                 check_ranks: bool | None = None):
        import torch.distributed as dist

        get_layout(layout)
        self.loader = loader
        self.layout = layout
        self.ignore_index = ignore_index
        self.group = group
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        if check_ranks is None:  # per batch, so only when asked for: "1" or "always" (the ring's default is its own)
            check_ranks = per_call_checks_enabled()
        self.check_ranks = bool(check_ranks) and self.world_size > 1

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            if self.check_ranks:
                check_same_batch(batch, self.group)
            yield shard_batch(batch, self.world_size, self.rank, self.layout, self.ignore_index)

    def __getattr__(self, name):  # sampler, dataset, batch_size, ... of the wrapped loader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
