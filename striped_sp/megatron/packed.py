"""Packed rows in Megatron: document bounds for the ring, from THD params or EOD-reset masks.

Megatron describes a packed (THD) row with ``PackedSeqParams``: ``cu_seqlens_q`` holds the real
document lengths and ``cu_seqlens_q_padded`` where each document sits in the token buffer (its
real tokens first, then padding up to a multiple of ``2 * CP``).  The ring takes one list of
global bounds for the whole buffer: :func:`thd_bounds` cuts each padded document into its real
tokens and its padding (two documents, so nobody attends across them: exact for any mask) under
``striped`` and ``contiguous``; ``zigzag`` keeps Megatron's padded documents (its layout cuts each
into ``2 * CP`` chunks), which is exact for causal attention, where no real token sees a later one.
A striped layout with a ``doc_placement`` keeps them too (:func:`keeps_padding`): its token order
depends on the bounds, and Megatron's RoPE sees only the padded ones.

``--reset-attention-mask`` builds a full ``[b, 1, s, s]`` boolean mask (``True`` = masked) with
one causal block per document; :func:`documents_from_mask` reads the bounds back from it and
checks that it is exactly that.  The bounds travel with the sliced mask tensor (``attach`` /
``attached``), so every attention layer reads them without touching the mask again.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Dict, Optional

import torch

from ..plan.layouts import get_layout

__all__ = ["keeps_padding", "thd_bounds", "documents_of", "documents_from_mask", "attach", "attached", "flatten_rows",
           "batch_seq_len"]

_CACHE_ATTR = "_striped_sp_bounds"
_MASK_ATTR = "_striped_sp_documents"


def boundary_ints(t) -> tuple[int, ...]:
    """A ``[n]`` or ``[1, n]`` boundary tensor (or list) as a tuple of ints."""
    if isinstance(t, torch.Tensor):
        if t.dim() == 2 and t.size(0) == 1:
            t = t[0]
        if t.dim() != 1:
            raise ValueError(f"cu_seqlens has shape {tuple(t.shape)}: expected [n] or [1, n] "
                             "(packed rows need --micro-batch-size 1)")
        return tuple(int(x) for x in t.tolist())
    return tuple(int(x) for x in t)


def keeps_padding(layout: str) -> bool:
    """Whether ``layout`` (a layout key) places tokens by the documents (``zigzag``: per document; a
    striped ``doc_placement``: whole documents on one rank), and so keeps each padded THD document
    whole, padding inside: then data, attention and RoPE (which gets only the padded boundaries
    from Megatron) all see the same documents and place the tokens alike; striped with
    ``stripe_size="doc"``: per-document stripes)."""
    return get_layout(layout).places_documents


def thd_bounds(cu_seqlens, cu_seqlens_padded, seq_len: int, layout: str | None) -> tuple[int, ...]:
    """Global document bounds of a THD buffer of ``seq_len`` tokens for the ring.

    ``cu_seqlens``: real boundaries ``[0, l1, l1+l2, ...]``; ``cu_seqlens_padded``: the padded
    ones (``None``: no padding).  The padding of a document is a document of its own unless
    :func:`keeps_padding` (``layout``; ``None``: the real documents, padding always apart).  Documents of length 0 (repeated boundaries) are dropped; tokens
    after the last padded boundary form one more document.  ``ValueError`` names the rule broken.
    """
    real = boundary_ints(cu_seqlens)
    padded = real if cu_seqlens_padded is None else boundary_ints(cu_seqlens_padded)
    if len(real) != len(padded):
        raise ValueError(f"cu_seqlens has {len(real)} entries and cu_seqlens_padded {len(padded)}: "
                         "they must describe the same documents")
    if not real or real[0] != 0 or padded[0] != 0:
        raise ValueError(f"cu_seqlens={list(real[:6])} and cu_seqlens_padded={list(padded[:6])} must start at 0")
    split = layout is None or not keeps_padding(layout)
    out = [0]
    for i in range(len(real) - 1):
        n, room = real[i + 1] - real[i], padded[i + 1] - padded[i]
        if n < 0 or room < n:
            raise ValueError(f"document {i}: {n} real tokens in a padded slot of {room} "
                             f"(cu_seqlens={list(real[:6])}..., cu_seqlens_padded={list(padded[:6])}...)")
        if room == 0:
            continue
        if 0 < n < room and split:
            out.append(padded[i] + n)
        out.append(padded[i + 1])
    if out[-1] > seq_len:
        raise ValueError(f"packed documents end at {out[-1]} but the row holds {seq_len} tokens")
    if out[-1] < seq_len:
        out.append(seq_len)
    return tuple(out)


def documents_of(params, seq_len: int, layout: str | None) -> tuple[int, ...]:
    """The ring's bounds for ``params`` (a THD ``PackedSeqParams``) under ``layout`` (``None``: the
    real documents, each padding a document of its own: :func:`thd_bounds`), computed once per object."""
    cache = getattr(params, _CACHE_ATTR, None)
    key = (seq_len, layout)
    if cache is not None and key in cache:
        return cache[key]
    fmt = getattr(params, "qkv_format", None)
    if fmt != "thd":
        raise ValueError(f"packed_seq_params.qkv_format={fmt!r}: context parallelism with striped_sp "
                         "supports packed rows in the 'thd' format only")
    q = thd_bounds(params.cu_seqlens_q, params.cu_seqlens_q_padded, seq_len, layout)
    if params.cu_seqlens_kv is not None and params.cu_seqlens_kv is not params.cu_seqlens_q:
        kv = thd_bounds(params.cu_seqlens_kv, params.cu_seqlens_kv_padded, seq_len, layout)
        if kv != q:
            raise ValueError("packed_seq_params: cu_seqlens_kv differs from cu_seqlens_q; "
                             "self-attention needs one set of documents")
    cache = dict(cache or {})
    cache[key] = q
    try:
        setattr(params, _CACHE_ATTR, cache)
    except (AttributeError, TypeError):  # a frozen params object: recompute next time
        pass
    return q


def _document_causal(bounds: torch.Tensor, rows: torch.Tensor, seq_len: int) -> torch.Tensor:
    """``[len(rows), seq_len]`` bool, ``True`` where row (a global position) must not see a key."""
    keys = torch.arange(seq_len, device=rows.device)
    start = bounds[torch.searchsorted(bounds, rows, right=True) - 1]
    return (keys[None, :] > rows[:, None]) | (keys[None, :] < start[:, None])


def documents_from_mask(mask: torch.Tensor, rows: Optional[torch.Tensor] = None,
                        chunk: int = 1024) -> tuple[tuple[int, ...], ...]:
    """Per-row document bounds of a Megatron attention mask, checked to be document-causal.

    ``mask``: bool ``[b, 1, sq, S]`` or ``[b, sq, S]`` (``True`` = masked, Megatron's convention),
    whose query rows are the global positions ``rows`` (default ``0..S-1``; with ``rows`` given
    only documents that start at a held row can be read, so pass the full mask when you can).
    Returns one bounds tuple per batch row.  ``ValueError`` if any entry differs from the plain
    causal mask inside the documents found (the ring cannot run arbitrary masks).
    """
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        raise ValueError(f"attention_mask must be a bool tensor (True = masked), got "
                         f"{getattr(mask, 'dtype', type(mask).__name__)}")
    m = mask[:, 0] if mask.dim() == 4 else mask
    if m.dim() != 3:
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}: expected [b, 1, sq, s]")
    seq_len = m.size(-1)
    if rows is None:
        if m.size(1) != seq_len:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}: expected a square [b, 1, s, s] mask")
        rows = torch.arange(seq_len, device=m.device)
    rows = rows.to(m.device)
    out = []
    for b in range(m.size(0)):
        row_mask = m[b]
        # A held row p > 0 starts a document iff it cannot see position p - 1.
        idx = torch.nonzero(rows > 0).flatten()
        starts = rows[idx][row_mask[idx, rows[idx] - 1]]
        bounds = torch.cat([torch.zeros(1, dtype=torch.int64, device=m.device), starts.to(torch.int64),
                            torch.tensor([seq_len], device=m.device)])
        bounds = torch.unique(bounds)
        for lo in range(0, rows.numel(), chunk):
            part = rows[lo:lo + chunk]
            want = _document_causal(bounds, part, seq_len)
            if not torch.equal(row_mask[lo:lo + chunk], want):
                bad = torch.nonzero(row_mask[lo:lo + chunk] != want)[0]
                raise ValueError(
                    f"attention_mask[{b}, 0, {lo + int(bad[0])}, {int(bad[1])}] breaks the document-causal "
                    "pattern: context parallelism with striped_sp runs causal attention inside documents "
                    "(--reset-attention-mask) and no other mask")
        out.append(tuple(int(x) for x in bounds.tolist()))
    return tuple(out)


_ATTACHED: dict = {}


def _storage_key(mask: torch.Tensor) -> tuple:
    return (mask.device, mask.data_ptr(), tuple(mask.shape), mask.stride(), mask.storage_offset())


def attach(mask: torch.Tensor, documents: tuple[tuple[int, ...], ...]) -> torch.Tensor:
    """Record ``documents`` (from :func:`documents_from_mask`) for ``mask``; returns ``mask``.

    Kept on the tensor object and in a table keyed by its storage, so that a detached copy of it
    (activation recomputation replays attention on ``mask.detach()``) finds them too; the entry
    goes when ``mask`` does."""
    setattr(mask, _MASK_ATTR, documents)
    key = _storage_key(mask)
    if key not in _ATTACHED:
        weakref.finalize(mask, _ATTACHED.pop, key, None)
    _ATTACHED[key] = documents
    return mask


def attached(mask: torch.Tensor) -> Optional[tuple[tuple[int, ...], ...]]:
    """The documents recorded by :func:`attach` for ``mask`` or a tensor viewing the same
    storage the same way, or ``None``."""
    found = getattr(mask, _MASK_ATTR, None)
    return found if found is not None else _ATTACHED.get(_storage_key(mask))


#: module-level because every attention layer of a forward flattens the same rows: a loop over the
#: documents once per batch (the next layers hash the tuple and find it), not once per layer
@functools.lru_cache(maxsize=8)
def flatten_rows(documents: tuple[tuple[int, ...], ...], batch: int) -> tuple[int, ...]:
    """Bounds of ``batch`` rows laid end to end (rows that share ``documents[0]`` when only one
    is given).  Under ``striped``, a ``[b, s/N]`` shard reshaped to ``[1, b*s/N]`` is exactly the
    striped shard of this flattened row, so one ring call serves the whole batch."""
    rows = documents if len(documents) == batch else documents * batch
    out = [0]
    for bounds in rows:
        base = out[-1]
        out.extend(base + x for x in bounds[1:])
    return tuple(out)


def batch_seq_len(batch: Dict[str, Any]) -> int:
    """The sequence length of a Megatron batch (``tokens``, else any ``[b, s]`` tensor)."""
    for key in ("tokens", "labels", "position_ids", "loss_mask"):
        val = batch.get(key)
        if isinstance(val, torch.Tensor) and val.dim() >= 2:
            return val.size(1)
    raise ValueError("a packed batch needs 'tokens' (or labels/position_ids/loss_mask) of shape [1, s]")
