"""Documents and padding of a full micro-batch: find them, and lay the tokens out as one packed row.

Hugging Face batches mark documents and padding three ways, all read here from the *full*
micro-batch (the same on every rank of the sequence-parallel group, so every rank derives the
same boundaries without a message):

* ``position_ids`` restarting at 0 for every document (``DataCollatorWithFlattening``);
* ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``):
  int boundaries ``[0, l1, l1+l2, ..., S]`` of the row, batch size 1;
* ``attention_mask`` with zeros at the end of a row (right padding, ordinary padded collators).

:func:`find_documents` returns the document lengths of every row's real tokens.  A batch with more
than one document in some row is laid out by :func:`pack_rows`: the real tokens of every row,
back to back, as one row (batch 1; padding dropped), padded as the layout needs
(:func:`striped_sp.pad_documents`: the row's tail for ``striped`` / ``contiguous``, every document
to a multiple of ``2N`` for ``zigzag``), with labels shifted inside each document.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import torch

from ..plan.layouts import positions
from ..plan.masks import as_bounds, check_cu_seqlens
from ..plan.packing import PaddedDocuments, pad_documents

__all__ = ["RowDocuments", "find_documents", "pack_rows", "shift_within_documents", "batch_bounds", "device_positions",
           "CU_KEYS", "MAX_KEYS"]

#: Hugging Face's flash-attention kwargs for packed rows (``DataCollatorWithFlattening``)
CU_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
MAX_KEYS = ("max_length_q", "max_length_k")


@dataclasses.dataclass(frozen=True)
class RowDocuments:
    """``lengths[i]``: the document lengths of row ``i``'s real tokens (they sum to ``valid[i]``);
    ``valid[i]``: the real tokens of row ``i`` (the rest of its ``seq_len``, at its end, is padding)."""

    lengths: tuple
    valid: tuple
    seq_len: int

    @property
    def packed(self) -> bool:
        """Some row holds more than one document."""
        return any(len(docs) > 1 for docs in self.lengths)

    @property
    def padded(self) -> bool:
        """Some row ends in padding."""
        return any(v < self.seq_len for v in self.valid)


def _valid_lengths(mask, batch_size: int, seq_len: int) -> list[int]:
    if mask is None:
        return [seq_len] * batch_size
    if not isinstance(mask, torch.Tensor) or mask.shape != (batch_size, seq_len):
        raise ValueError(f"batch['attention_mask'] must be a [batch, seq] = [{batch_size}, {seq_len}] tensor, "
                         f"got {tuple(getattr(mask, 'shape', ()))}")
    keep = mask.bool()
    valid = keep.sum(1)
    right_padded = torch.arange(seq_len).unsqueeze(0) < valid.unsqueeze(1)
    bad = (keep != right_padded).any(1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(
            f"batch['attention_mask'] row {bad[0]} has padding before a real token (left padding or a "
            "hole): only right padding (ones, then zeros) is taken; set the tokenizer's "
            "padding_side='right', or pack the rows (DataCollatorWithFlattening)")
    return valid.tolist()


def _given_bounds(batch: Mapping[str, Any], batch_size: int, seq_len: int):
    given = {k: batch[k] for k in CU_KEYS if batch.get(k) is not None}
    if not given:
        return None
    bounds = {k: check_cu_seqlens_named(k, v, seq_len) for k, v in given.items()}
    if len(set(bounds.values())) > 1:
        raise ValueError(f"batch['cu_seq_lens_q'] and batch['cu_seq_lens_k'] differ ({bounds['cu_seq_lens_q'][:6]} "
                         f"vs {bounds['cu_seq_lens_k'][:6]}): causal self-attention over packed documents "
                         "needs one set of boundaries")
    if batch_size != 1:
        raise ValueError(f"batch['cu_seq_lens_q'] comes with batch size {batch_size}: packed rows have "
                         "batch size 1 (DataCollatorWithFlattening)")
    return next(iter(bounds.values()))


def check_cu_seqlens_named(key: str, value, seq_len: int) -> tuple[int, ...]:
    """``value`` checked as the boundaries of a row of ``seq_len`` tokens; errors name ``key``."""
    try:
        return check_cu_seqlens(value, seq_len, 1)
    except ValueError as err:
        raise ValueError(f"batch[{key!r}]: {err}") from None


def _documents_from_positions(pos: torch.Tensor, row: int) -> list[int] | None:
    """Document lengths of one row's real-token ``position_ids``; ``None`` for ``0, 1, 2, ...``."""
    n = pos.numel()
    if n == 0:
        return []
    step = pos[1:] - pos[:-1]
    restart = (pos[1:] == 0) & (step != 1)
    ok = (step == 1) | restart
    if not bool(restart.any()) and bool(ok.all()):
        return None  # one run p0, p0 + 1, ...: no documents
    if int(pos[0]) != 0 or not bool(ok.all()):
        bad = 0 if int(pos[0]) != 0 else int((~ok).nonzero()[0]) + 1
        raise ValueError(
            f"batch['position_ids'] row {row} at token {bad} ({pos[max(bad - 2, 0):bad + 3].tolist()}...): "
            "position_ids must count up by 1 (p, p + 1, ...), or restart at 0 for every packed document "
            "(as DataCollatorWithFlattening gives them)")
    starts = [0] + (restart.nonzero().flatten() + 1).tolist()
    return [b - a for a, b in zip(starts, starts[1:] + [n])]


def find_documents(batch: Mapping[str, Any], batch_size: int, seq_len: int) -> RowDocuments:
    """The documents of every row of a full batch of ``[batch_size, seq_len]`` tokens.

    Raises ``ValueError`` naming the key for: an ``attention_mask`` that is not right padding;
    ``cu_seq_lens_q/k`` that are not valid boundaries of the row, differ from each other, or come
    with a batch of more than one row; ``position_ids`` that neither count ``0, 1, 2, ...`` nor
    restart at 0 per document, or whose restarts disagree with ``cu_seq_lens_q``.  A row whose
    ``position_ids`` count up by 1 from any start holds one document (unless ``cu_seq_lens_q``
    says otherwise)."""
    valid = _valid_lengths(batch.get("attention_mask"), batch_size, seq_len)
    bounds = _given_bounds(batch, batch_size, seq_len)
    if bounds is not None and valid[0] != seq_len:
        raise ValueError("batch['cu_seq_lens_q'] and an attention_mask with padding: give one of them (packed "
                         "rows carry no padding)")
    pos = batch.get("position_ids")
    if pos is not None:
        if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.size(1) != seq_len or pos.size(0) not in (1, batch_size):
            raise ValueError(f"batch['position_ids'] must be a [batch, seq] tensor of {seq_len} tokens, "
                             f"got {tuple(getattr(pos, 'shape', ()))}")
        pos = pos.expand(batch_size, -1)
    lengths = []
    for i in range(batch_size):
        docs = None if pos is None else _documents_from_positions(pos[i, :valid[i]], i)
        if bounds is not None:
            from_cu = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
            if docs is not None and docs != from_cu:
                raise ValueError(
                    f"batch['position_ids'] restart at other tokens than batch['cu_seq_lens_q'] marks "
                    f"({list(bounds[:6])}...): they must describe the same documents")
            docs = from_cu
        lengths.append(tuple(docs) if docs else ((valid[i],) if valid[i] else ()))
    return RowDocuments(tuple(lengths), tuple(valid), seq_len)


def shift_within_documents(labels: torch.Tensor, bounds, ignore_index: int) -> torch.Tensor:
    """``labels`` ``[1, S]`` shifted left by one inside every document of ``bounds``: the target of a
    document's last token is ``ignore_index`` (no target crosses a boundary)."""
    out = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], ignore_index)], dim=1)
    last = torch.as_tensor(list(bounds[1:]), dtype=torch.int64, device=labels.device) - 1
    out[:, last] = ignore_index
    return out


def _per_document_positions(padded: PaddedDocuments, device) -> torch.Tensor:
    bounds = padded.cu_seqlens
    pos = torch.arange(padded.seq_len)
    doc = torch.searchsorted(bounds[1:], pos, right=True)
    return (pos - bounds[doc]).unsqueeze(0).to(device)


def pack_rows(batch: Mapping[str, Any], docs: RowDocuments, world_size: int, layout: str,
              ignore_index: int) -> tuple[dict, PaddedDocuments]:
    """The full batch as one packed, padded row (every per-token tensor ``[1, S_padded, ...]``).

    Real tokens of every row go back to back (padding dropped); ``pad_documents`` pads the row for
    ``layout`` on ``world_size`` ranks.  Returns the batch (``shift_labels`` shifted inside
    documents, ``ignore_index`` on padding; ``position_ids`` restarting at 0 per padded document;
    ``cu_seq_lens_q/k`` int32 and ``max_length_q/k`` of the padded row; TRL's ``seq_idx``, if given,
    rebuilt as the document index of every token of the padded row; no ``attention_mask`` and no
    ``labels``) and the :class:`~striped_sp.plan.packing.PaddedDocuments` (its ``cu_seqlens`` are the
    boundaries to shard with).  Nothing is sharded here."""
    ids = batch["input_ids"]
    b, s = ids.shape
    keep = (torch.arange(s).unsqueeze(0) < torch.tensor(docs.valid).unsqueeze(1)).flatten().nonzero().flatten()
    keep = keep.to(ids.device)
    lengths = [n for row in docs.lengths for n in row]
    if not lengths:
        raise ValueError("batch['attention_mask'] marks no real token in any row")
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    padded = pad_documents(bounds, world_size, layout)

    def flat(x: torch.Tensor) -> torch.Tensor:
        x = x.expand(b, *x.shape[1:]) if x.size(0) == 1 else x
        return x.reshape(b * s, *x.shape[2:]).index_select(0, keep).unsqueeze(0)

    out = {}
    shifted = None
    if batch.get("shift_labels") is not None:  # already shifted: still no target across a document end
        shifted = flat(batch["shift_labels"])
        shifted[:, torch.tensor(bounds[1:]) - 1] = ignore_index
    elif batch.get("labels") is not None:
        shifted = shift_within_documents(flat(batch["labels"]), bounds, ignore_index)
    skip = {"attention_mask", "position_ids", "labels", "shift_labels", "seq_idx", *CU_KEYS, *MAX_KEYS}
    for key, value in batch.items():
        if key in skip:
            continue
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == s and value.size(0) in (1, b):
            out[key] = padded.pad(flat(value), dim=1, value=0)
        else:
            out[key] = value
    if shifted is not None:
        out["shift_labels"] = padded.pad(shifted, dim=1, value=ignore_index)
    out["position_ids"] = _per_document_positions(padded, ids.device)
    if batch.get("seq_idx") is not None:  # TRL's document index per token, of the padded row
        sizes = padded.cu_seqlens[1:] - padded.cu_seqlens[:-1]
        doc = torch.repeat_interleave(torch.arange(sizes.numel(), dtype=torch.int32), sizes)
        out["seq_idx"] = doc.unsqueeze(0).to(device=ids.device, dtype=batch["seq_idx"].dtype)
    cu = padded.cu_seqlens.to(device=ids.device, dtype=torch.int32)
    longest = int((padded.cu_seqlens[1:] - padded.cu_seqlens[:-1]).max())
    out.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
    return out, padded


# -- per batch, not per layer ----------------------------------------------------------------------

#: ``(cu_seq_lens_q, cu_seq_lens_k, their versions, bounds)`` of the batch seen last.  Module-level
#: because every attention layer of a forward receives the same boundary tensors: they are read on
#: the host (a device synchronisation on CUDA) once per batch, not once per layer.  Holding the
#: tensors keeps their ids from being reused by another batch's while the entry lives.
_LAST_BOUNDS = None


def batch_bounds(cu_q, cu_k=None) -> tuple[int, ...] | None:
    """The global document boundaries of ``cu_q`` / ``cu_k`` (``cu_seq_lens_q`` / ``_k``, or a
    layer's ``cu_seqlens``; ``None`` without either) as a tuple of ints, read on the host once per
    batch: a call with the same tensor objects, unmodified since (their ``_version``), returns the
    last result without reading them again (lists and inference-mode tensors, which carry no
    version, are read every time).  ``ValueError`` when both are given and differ."""
    global _LAST_BOUNDS
    if cu_q is None and cu_k is None:
        return None
    given = [t for t in (cu_q, cu_k) if t is not None]
    # only tensors with a version counter can be recognised unchanged (not lists, not inference tensors)
    tracked = all(isinstance(t, torch.Tensor) and not t.is_inference() for t in given)
    versions = tuple(None if t is None else t._version for t in (cu_q, cu_k)) if tracked else None
    last = _LAST_BOUNDS
    if tracked and last is not None and last[0] is cu_q and last[1] is cu_k and last[2] == versions:
        return last[3]
    if cu_q is not None and cu_k is not None:
        same = (torch.equal(cu_q, cu_k) if isinstance(cu_q, torch.Tensor) and isinstance(cu_k, torch.Tensor)
                else list(cu_q) == list(cu_k))
        if not same:
            raise ValueError("cu_seq_lens_q and cu_seq_lens_k differ: causal self-attention over packed documents "
                             "needs one set of boundaries (of the global row)")
    bounds = as_bounds(cu_q if cu_k is None else cu_k)
    _LAST_BOUNDS = (cu_q, cu_k, versions, bounds) if tracked else None
    return bounds


#: the rotary index of the last few (row, rank, layout, documents, device): module-level because
#: every layer's rotary table of a batch gathers the same positions, which are built and copied to
#: the device once per batch instead of once per layer (a blocking copy on CUDA); a few entries
#: cover the layer kinds of one model
@functools.lru_cache(maxsize=8)
def device_positions(seq_len: int, world_size: int, rank: int, layout: str, bounds: tuple | None,
                     device: torch.device) -> torch.Tensor:
    """:func:`striped_sp.positions` of ``rank`` on ``device`` (int64), cached per batch."""
    return positions(seq_len, world_size, rank, layout, bounds).to(device)
