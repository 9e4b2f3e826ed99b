"""Packed rows sharded by their documents: the check that the tokens a rank holds are the ones its plan runs.

Under a layout that places the tokens of a packed row by its documents (the default ``striped``'s
per-batch search, per-document stripes, whole-document placement, ``zigzag``), which tokens rank
``r`` holds depends on ``cu_seqlens``: ``shard(t, n, r, cu_seqlens=cu)`` and ``shard(t, n, r)`` give
other tokens, and the ring, which plans the row from ``cu_seqlens``, is only right for the first.
Nothing in ``q``, ``k``, ``v`` tells them apart, so :func:`striped_sp.shard` records the rows it
shards with their documents (:func:`record_sharded`) and the ring asks (:func:`sharding_state`)
before it runs a packed row whose placement differs from the dense one; a row sharded in another
process (a ``DataLoader`` worker) is declared by the caller (``sharded_by_documents=True``)."""

from __future__ import annotations

import collections

import torch

from .masks import as_bounds

__all__ = ["record_sharded", "documents_move_tokens", "sharding_state", "sharding_error"]

#: (layout key, world size, bounds) of the last rows :func:`striped_sp.shard` sharded with their documents:
#: module-level because the engine checks, without any message, that the packed row it runs was sharded so
#: in this process (the shard and the ring meet nowhere else); a few entries cover batches sharded ahead
_SHARDED: collections.deque = collections.deque(maxlen=8)
#: (layout key, seq_len, world size, bounds) -> whether the documents move tokens: module-level because
#: ``ring_attention`` builds its request anew in every layer, and the answer is a pass over the whole row
_MOVES: collections.OrderedDict = collections.OrderedDict()
_MOVES_SIZE = 8


def record_sharded(layout, world_size: int, cu_seqlens) -> None:
    """Note that this process sharded the row of ``cu_seqlens`` under ``layout`` on ``world_size``
    ranks with its documents (called by :func:`striped_sp.shard`)."""
    if not layout.places_documents:
        return
    bounds = as_bounds(cu_seqlens)
    entry = (layout.key, world_size, bounds)
    if len(bounds) > 2 and entry not in _SHARDED:
        _SHARDED.append(entry)


def documents_move_tokens(layout, seq_len: int, world_size: int, bounds: tuple) -> bool:
    """Whether some rank holds other tokens of the row under ``layout`` with the documents ``bounds``
    than without them (a dense ``shard``); the same answer on every rank."""
    if not layout.places_documents or len(bounds) <= 2:
        return False
    key = (layout.key, seq_len, world_size, bounds)
    found = _MOVES.pop(key, None)
    if found is None:
        try:
            layout.check_seq_len(seq_len, world_size)
        except ValueError:  # no dense shard of this row exists: nothing to mix up
            found = False
        else:
            found = any(not torch.equal(layout.positions(seq_len, world_size, r, bounds),
                                        layout.positions(seq_len, world_size, r, None)) for r in range(world_size))
        if len(_MOVES) >= _MOVES_SIZE:
            _MOVES.popitem(last=False)
    _MOVES[key] = found
    return found


def sharding_state(layout, seq_len: int, world_size: int, bounds, declared: bool) -> bool | None:
    """``None``: nothing to check (no documents, documents that move no token, or sharding by documents
    ``declared`` by the caller); ``True``: this process sharded the row with its documents; ``False``:
    it did not, and the ring would run the row's plan on tokens the rank may not hold."""
    if declared or bounds is None or not documents_move_tokens(layout, seq_len, world_size, bounds):
        return None
    return (layout.key, world_size, bounds) in _SHARDED


def sharding_error(what: str, layout, seq_len: int, world_size: int, bounds) -> str:
    """The message for a packed row run without having been sharded by its documents."""
    key = layout.key
    return (
        f"{what}: layout {key!r} places the tokens of a packed row by its documents (cu_seqlens: "
        f"{len(bounds) - 1} documents, {seq_len} tokens on {world_size} ranks; rank 0 holds positions "
        f"{layout.positions(seq_len, world_size, 0, bounds)[:4].tolist()}... with them, "
        f"{layout.positions(seq_len, world_size, 0, None)[:4].tolist()}... without), and no "
        "striped_sp.shard(..., cu_seqlens=) of this row ran in this process: inputs sharded without their "
        "documents (striped_sp.shard(t, n, rank)) hold other tokens, and the result would be wrong. Shard every "
        f"per-token tensor with the documents: striped_sp.shard(t, n, rank, layout={key!r}, cu_seqlens=cu) (also "
        "for labels, loss mask and positions); where the row is sharded by its documents in another process (a "
        "DataLoader worker), pass sharded_by_documents=True; or pin a layout whose placement ignores the "
        "documents (layout='striped:stripe=1', 'contiguous')")
