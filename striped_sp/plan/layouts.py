"""Token layouts: which global tokens a rank holds, and the kernel calls of each ring block.

A layout is pure data and arithmetic; it never touches a process group.  For the ring, a
layout answers one question: when the queries of rank ``i`` meet the keys/values of rank
``j``, which kernel calls cover exactly the causal part of that block?  The answer is a
list of :class:`BlockCall`, each a query slice, a key slice and a causal flag, on *local*
indices.  Causal calls are always square, so top-left and bottom-right mask alignment agree
(the CPU kernel aligns top-left, flash-attn 2 bottom-right).

Layouts (sequence of ``S`` tokens on ``N`` ranks, ``n = S / N`` tokens per rank):

* ``contiguous``: rank ``r`` holds ``r*n ... (r+1)*n - 1`` (original Ring Attention).
* ``zigzag``: the sequence is cut into ``2N`` chunks; rank ``r`` holds chunks ``r`` and
  ``2N-1-r`` (Megatron-LM / Transformer Engine's load-balanced layout).
* ``striped``: rank ``r`` holds ``r, r+N, r+2N, ...`` (Striped Attention, arXiv 2311.09431).

With packed documents (``cu_seqlens``) ``striped`` and ``contiguous`` keep their positions, while
``zigzag`` follows Transformer Engine's THD rule: every document (padded to a multiple of ``2N``)
is cut into ``2N`` chunks and rank ``r`` holds chunks ``r`` and ``2N-1-r`` of each.  Every layout
describes its tokens as *runs* (local start, first position, count) with one stride, from which
both the positions and the masked block plans (:mod:`striped_sp.plan.masks`) derive.

This module names the layout API in one place; the parts live in modules of one job each:

* :mod:`striped_sp.plan.layout_base`: :class:`Layout` (the base class and its facts) and :class:`BlockCall`;
* :mod:`striped_sp.plan.chunk_layouts`: ``contiguous`` and ``zigzag``;
* :mod:`striped_sp.plan.striped_layout`: ``striped`` and its parameters;
* :mod:`striped_sp.plan.layout_registry`: :data:`LAYOUTS`, :data:`ALGOS`, :func:`get_layout`;
* :mod:`striped_sp.plan.sharding`: :func:`positions`, :func:`shard`, :func:`unshard`.
"""

from __future__ import annotations

# every name importable from here before the split stays importable from here
from .chunk_layouts import Contiguous, Zigzag
from .layout_base import _ALL, BlockCall, Layout
from .layout_registry import ALGOS, LAYOUTS, _parse_params, get_layout
from .sharding import _check_dim, _check_rank, positions, shard, unshard
from .striped_layout import Striped, _bounds

__all__ = [
    "BlockCall",
    "Layout",
    "LAYOUTS",
    "get_layout",
    "positions",
    "shard",
    "unshard",
]
