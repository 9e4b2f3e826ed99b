"""Where a striped layout puts each document of a packed row: striped over every rank, or whole.

Striping cuts a document of ``L`` tokens into ``N`` pieces of ``L / N`` tokens, and every ring
block meets a piece of every striped document: balanced, but small pieces cost more per score
entry than large ones.  A document short enough can instead stay whole on one rank, where its
attention runs in one piece, at the ring's first step, with no transfer.  This module decides:

* which documents stay whole (``doc_placement``: ``"split"`` none, an int ``L`` those of at most
  ``L`` tokens; ``"auto"``: the length the cost model predicts fastest, chosen by
  :mod:`striped_sp.plan.search`);
* where each whole document goes: a greedy balancing solver (largest cost first, to the rank with
  the least work that still has room), so that every rank ends with exactly ``S / N`` tokens; a
  document that fits nowhere whole is cut into contiguous pieces on the ranks with room left;
* how the other documents are striped: concatenated in row order into one sub-row, dealt token by
  token (``stripe_size = 1``: a run of step ``N`` per document and rank) or in stripes of
  ``stripe_size`` tokens (stripe ``g`` to rank ``g mod N``).

The result, per rank, is a table of runs ``(local_start, first_position, count, step)``
(:meth:`striped_sp.plan.layouts.Layout.run_table`): striped runs first, then the pieces of cut
documents, then whole documents.  It is a pure function of the boundaries, ``N``, the stripe size
and the policy, so every rank, the data loader and the ring compute the same placement.
"""

from __future__ import annotations

import bisect
import numbers

import torch

from . import doc_stripes
from .cost import CostModel, model_named
from .mirror import striped_room
from .solver import assign_greedy

__all__ = ["check_placement", "check_stripe_size", "predict", "table_step_entries"]


def check_placement(doc_placement):
    """``"split"``, ``"auto"`` or a positive int (the longest document kept whole); else ``ValueError``."""
    if doc_placement in ("split", "auto"):
        return doc_placement
    if isinstance(doc_placement, numbers.Integral) and not isinstance(doc_placement, bool) and doc_placement >= 1:
        return int(doc_placement)
    raise ValueError(f"doc_placement={doc_placement!r} must be 'split', 'auto' or a positive int "
                     "(the longest document kept whole on one rank)")


def check_stripe_size(stripe_size):
    """A positive int, ``"doc"`` (per-document stripes, :mod:`striped_sp.plan.doc_stripes`) or ``"auto"``
    (per batch, the fastest plan: :mod:`striped_sp.plan.search`); else ``ValueError``."""
    if stripe_size in ("doc", "auto") and isinstance(stripe_size, str):
        return stripe_size
    if isinstance(stripe_size, numbers.Integral) and not isinstance(stripe_size, bool) and stripe_size >= 1:
        return int(stripe_size)
    raise ValueError(f"stripe_size={stripe_size!r} must be a positive int, 'doc' (per document: 2N stripes "
                     "dealt to ranks 0..N-1 then N-1..0) or 'auto' (the fastest plan for each batch)")


def _lengths(bounds: tuple) -> list[int]:
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


def _striped_runs(bounds, striped: list[int], world_size: int, stripe: int, order: str = "round") -> list[list[tuple]]:
    """Per rank, the runs ``(first_position, count, step)`` of the striped documents (indices
    ``striped``), dealt in row order as one sub-row."""
    rows = doc_stripes.striped_rows(bounds, striped, world_size, stripe, order)
    per_rank = torch.bincount(rows[:, 0], minlength=world_size).tolist()
    return [list(map(tuple, r[:, 1:].tolist())) for r in torch.split(rows, per_rank)]


def _entries(length: int) -> int:
    return length * (length + 1) // 2


def _assign_whole(bounds, whole: list[int], capacity: list[int], cut_max: int):
    """Whole documents by :func:`~striped_sp.plan.solver.assign_greedy`.  A document that fits
    nowhere whole is cut into contiguous pieces over the ranks with the most room if it has at
    most ``cut_max`` tokens (its cross-rank blocks stay small); longer ones are returned as
    ``unfit``.  Returns per rank ``[(first_position, count)]`` (cut pieces first), the entries per
    rank and the unfit documents."""
    import heapq

    n = len(capacity)
    lengths = {d: bounds[d + 1] - bounds[d] for d in whole}
    room = list(capacity)
    kept_docs, left, work = assign_greedy(lengths, whole, room)
    kept = [[(bounds[d], lengths[d]) for d in docs] for docs in kept_docs]
    unfit = [d for d in left if lengths[d] > cut_max]
    cut = [[] for _ in range(n)]
    roomiest = [(-room[r], r) for r in range(n) if room[r] > 0]  # the most room first, ties lower rank
    heapq.heapify(roomiest)
    for d in (d for d in left if lengths[d] <= cut_max):
        pos, end = bounds[d], bounds[d + 1]
        while pos < end and roomiest:
            _, r = heapq.heappop(roomiest)
            take = min(room[r], end - pos)
            cut[r].append((pos, take))
            room[r] -= take
            work[r] += _entries(take)
            pos += take
            if room[r]:  # the document's last piece: the rank keeps some room
                heapq.heappush(roomiest, (-room[r], r))
    return [c + sorted(k) for c, k in zip(cut, kept)], work, unfit


def _striped_capacity(bounds, striped, world_size, stripe, local, order="round"):
    runs = _striped_runs(bounds, striped, world_size, stripe, order)
    return runs, [local - sum(c for _, c, _ in r) for r in runs]


def _place(bounds: tuple, world_size: int, stripe: int, whole_max: int, tables: bool = True, order: str = "round"):
    """``(run tables per rank, whole documents, striped documents, whole entries per rank)``
    (``tables=False``: per rank the ``(first_position, count)`` of the documents placed whole or
    cut instead of the tables).

    Documents of at most ``whole_max`` tokens start out whole; the striped ones fix each rank's
    room.  While a whole candidate is too long to fit (or to cut harmlessly: a cut document's
    cross-rank block lands on one rank at one step), the longest such one is striped instead and
    the rest placed again; after ``2N`` tries the leftovers are cut.

    Each try costs little: a rank's striped tokens depend only on how many tokens are striped
    (whole stripes dealt round the ranks), and the greedy (:class:`~striped_sp.plan.solver.Rerun`)
    replays only from the first document whose rank lost the room for it, stopping at the first
    one that fits nowhere (the longest unfit one is the last document of its length from there)."""
    from .solver import Rerun

    n = world_size
    seq_len = bounds[-1]
    local = seq_len // n
    lengths = _lengths(bounds)
    cut_max = max(64, local // 64)
    whole = [d for d, x in enumerate(lengths) if x <= min(whole_max, local)]
    whole_set = set(whole)
    striped_tokens = sum(x for d, x in enumerate(lengths) if d not in whole_set)
    greedy = Rerun(sorted(whole, key=lambda d: (-lengths[d], d)), lengths, n)
    for attempt in range(2 * n + 1):
        if attempt == 2 * n:
            cut_max = local  # give up moving documents: cut what is left (predict counts the cost)
        # the striped sub-row is dealt in whole rounds of N stripes, then a part round
        capacity = striped_room(striped_tokens, n, stripe, local, order)
        if min(capacity) < 0 or (not whole and max(capacity) > 0):
            raise ValueError(
                f"stripe_size={stripe}: the striped documents ({seq_len - sum(capacity)} tokens) do not fall "
                f"evenly on {world_size} ranks of {local} tokens (room left per rank {capacity}); use a stripe "
                "size that divides the row by world_size * stripe_size, or doc_placement='auto' to fill the "
                "ranks with whole documents")
        stop = greedy.run(capacity, cut_max)
        if stop == len(greedy.docs):
            break
        # the longest unfit one is striped instead; the rooms shrink evenly and the rest is placed again
        length = greedy.lengths[stop]
        last = bisect.bisect_right(greedy.lengths, -length, lo=stop, key=lambda x: -x) - 1
        drop = greedy.docs[last]
        greedy.remove([last])
        whole.remove(drop)
        striped_tokens += length
    placed, entries, _ = _assign_whole(bounds, whole, capacity, cut_max)
    whole_set = set(whole)
    striped = [d for d in range(len(lengths)) if d not in whole_set]
    if not tables:
        return placed, whole, striped, entries
    placed_rows = torch.tensor([(r, p, c, 1) for r in range(n) for p, c in placed[r]], dtype=torch.int64)
    tables = doc_stripes.run_tables(n, [doc_stripes.striped_rows(bounds, striped, n, stripe, order), placed_rows])
    return tables, whole, striped, entries


def _placed_pieces(bounds: tuple, world_size: int, stripe: int, whole_max: int, order: str = "round"):
    """``(pieces, striped)`` of :func:`_place` without its run tables, for predictions: per rank the
    ``(document, count)`` of the documents placed whole or cut (:func:`_whole_pieces` of the
    tables, empty pieces left out), and the striped documents."""
    placed, _, striped, _ = _place(bounds, world_size, stripe, whole_max, tables=False, order=order)
    # the document holding a piece's first position: the last one starting at or before it
    return [[(bisect.bisect_right(bounds, p) - 1, c) for p, c in rows if c] for rows in placed], striped


def _whole_pieces(bounds: tuple, tables: list, whole: list) -> list[list[tuple[int, int]]]:
    """Per rank, ``(document, count)`` of the pieces of documents placed whole (or cut)."""
    rows = torch.cat([t.reshape(-1, 4) for t in tables])
    doc = torch.searchsorted(torch.tensor(bounds, dtype=torch.int64), rows[:, 1].contiguous(), right=True) - 1
    keep = (rows[:, 3] == 1) & torch.isin(doc, torch.tensor(sorted(set(whole)), dtype=torch.int64))
    per_rank = torch.split(torch.stack([doc, rows[:, 2]], 1)[keep],
                           [int(k.sum()) for k in torch.split(keep, [len(t) for t in tables])])
    return [list(map(tuple, p.tolist())) for p in per_rank]


def _cross_entries(pieces: list) -> int:
    """Score entries between the pieces of documents cut over several ranks: per document, each
    piece times the pieces before it, ``((sum c)^2 - sum c^2) / 2``."""
    totals: dict = {}
    squares = 0
    for rows in pieces:
        for doc, count in rows:
            totals[doc] = totals.get(doc, 0) + count
            squares += count * count
    return (sum(t * t for t in totals.values()) - squares) // 2


def _piece(length: int, world_size: int, stripe: int) -> float:
    """Rows of the pieces a striped document of ``length`` tokens is cut into on one rank."""
    return length / world_size if stripe == 1 else min(stripe, length)


def _striped_doc_ns(model: CostModel, length: int, world_size: int, stripe: int) -> float:
    """Forward time per head of one ring step's block of a document of ``length`` tokens striped over
    ``world_size`` ranks in stripes of ``stripe``: stripes of 1 one causal call over the rank's
    ``length / N`` rows; larger stripes ``k = length / (N * stripe)`` per rank meet as ``k`` causal
    ``stripe x stripe`` squares on the diagonal and ``k (k - 1) / 2`` dense ones below it, which the
    kernels run as one prefix call per query stripe (no diagonal waste)."""
    rows = length / world_size
    k = rows / stripe
    if stripe == 1 or k <= 1:
        return model.call(rows, rows, True)
    dense = model.ns_per_entry * (k * (k - 1) / 2 * stripe * stripe) * (1 + model.small_rows / stripe)
    return k * model.call(stripe, stripe, True) + dense + (k - 1) * model.call_ns


def table_step_entries(bounds: tuple, world_size: int, tables: list) -> torch.Tensor:
    """``entries[t, r]`` (float64): the visible causal score entries of rank ``r`` on ring step ``t``
    (keys of rank ``(r - t) mod N``) of a packed row placed by the run ``tables`` (per rank, rows
    ``(local start, first position, count, step)``): what ``bench balance`` counts from the engine's
    plans, for any placement, in closed form per pair of runs of one document.

    Runs of step 1 (whole documents, cut pieces, stripes of ``s``) are intervals: a query run meets
    every key token of its document before it, and its own triangle.  Runs of step ``N`` (stripes of
    1: one run per rank and document, first positions inside the document's first ``N``) meet as
    ``sum_x min(c_k, x + [b <= a])`` over the query run's ``c_q`` tokens (``a``, ``b``: the runs'
    first positions)."""
    n = world_size
    rows = torch.cat([t.reshape(-1, 4) for t in tables]).to(torch.int64)
    rank = torch.repeat_interleave(torch.arange(n), torch.tensor([t.reshape(-1, 4).shape[0] for t in tables],
                                                                 dtype=torch.int64))
    keep = rows[:, 2] > 0
    rows, rank = rows[keep], rank[keep]
    first, count, step = (rows[:, k].contiguous() for k in (1, 2, 3))
    b = torch.tensor(bounds, dtype=torch.int64)
    doc = torch.searchsorted(b, first, right=True) - 1
    pairs = torch.zeros(n, n, dtype=torch.float64)  # pairs[i, j]: queries on rank i x keys on rank j
    strided_doc = torch.zeros(len(bounds) - 1, dtype=torch.bool)
    strided_doc[doc[step != 1]] = True
    strided = strided_doc[doc]
    # intervals: sorted by position; each run meets the tokens of every rank before it in its document
    order = torch.argsort(first[~strided])
    f, c, r, d = (x[~strided][order] for x in (first, count, rank, doc))
    if len(f):
        onehot = torch.zeros(len(f), n, dtype=torch.float64)
        onehot[torch.arange(len(f)), r] = c.to(torch.float64)
        before = torch.cumsum(onehot, 0) - onehot  # tokens of each rank before the run (the row)
        new_doc = torch.ones(len(f), dtype=torch.bool)
        new_doc[1:] = d[1:] != d[:-1]
        doc_first = torch.cummax(torch.where(new_doc, torch.arange(len(f)), torch.zeros_like(f)), 0).values
        before = before - before[doc_first]  # ... in its document
        cf = c.to(torch.float64)
        pairs.index_add_(0, r, cf[:, None] * before)
        pairs[torch.arange(n), torch.arange(n)] += torch.zeros(n, dtype=torch.float64).index_add_(
            0, r, cf * (cf + 1) / 2)
    # stripes of 1: per document one run per rank, dense [documents, N] of (first, count)
    if bool(strided.any()):
        docs, slot = torch.unique(doc[strided], return_inverse=True)
        if len(torch.unique(slot * n + rank[strided])) != int(strided.sum()):
            raise ValueError("a rank holds a striped document in several strided runs")
        fa = torch.zeros(len(docs), n, dtype=torch.int64)
        ca = torch.zeros(len(docs), n, dtype=torch.int64)
        fa[slot, rank[strided]] = first[strided]
        ca[slot, rank[strided]] = count[strided]
        chunk = max(1, (1 << 22) // (n * n))
        for lo in range(0, len(docs), chunk):
            a, cq = fa[lo:lo + chunk, :, None], ca[lo:lo + chunk, :, None].to(torch.float64)  # queries: rank i
            bb, ck = fa[lo:lo + chunk, None, :], ca[lo:lo + chunk, None, :].to(torch.float64)  # keys: rank j
            e = (bb <= a).to(torch.float64)
            k = torch.clamp(ck - e + 1, min=0)
            k = torch.minimum(k, cq)
            pairs += (k * (k - 1) / 2 + e * k + (cq - k) * ck).sum(0)
    ranks = torch.arange(n)
    return torch.stack([pairs[ranks, (ranks - t) % n] for t in range(n)])


def predict(bounds, world_size: int, stripe: int, whole_max: int, model: CostModel | str | None = None,
            order: str = "round") -> dict:
    """A placement's ``balance``: critical path over ideal in score entries (the sum over ring steps
    of the busiest rank's visible entries, :func:`table_step_entries`, over the row's visible entries
    spread evenly on ``N`` ranks: what ``bench balance`` prints for the plan), and the model's ``ms``,
    its forward critical path per head in milliseconds (whole documents cost one causal call each on
    their rank; a striped document one piece per rank and ring step)."""
    model = model_named(model)
    bounds = tuple(bounds)
    if stripe == "doc":
        return _predict_doc(bounds, world_size, whole_max, model)
    tables, whole, striped, _ = _place(bounds, world_size, stripe, whole_max, order=order)
    pieces = _whole_pieces(bounds, tables, whole)
    lengths = _lengths(bounds)
    ideal = sum(_entries(n) for n in lengths) / world_size
    try:
        balance = float(table_step_entries(bounds, world_size, tables).max(1).values.sum()) / ideal
    except ValueError:  # mirrored stripes of 1: two strided runs per document and rank, no closed form here
        balance = float("nan")
    whole_ns = [sum(model.call(c, c, True) for _, c in rows) for rows in pieces]
    per_step = sum(_striped_doc_ns(model, lengths[d], world_size, stripe) for d in striped)
    return {"balance": balance, "ms": (max(whole_ns) + world_size * per_step) / 1e6}


def _predict_doc(bounds: tuple, world_size: int, whole_max: int, model: CostModel) -> dict:
    """:func:`predict` for per-document stripes: the exact entries of every (step, rank) block."""
    _, kept, _, counts = doc_stripes.place(bounds, world_size, whole_max, tables=False)
    entries = doc_stripes.step_entries(bounds, world_size, kept, counts)
    ideal = float(entries.sum()) / world_size
    balance = float(entries.max(1).values.sum()) / ideal if ideal else 1.0

    cost = doc_stripes.step_cost(bounds, world_size, kept, counts, lambda m: model.call_tensor(m, m, True),
                                 lambda q, k: model.call_tensor(q, k, False), model.rect_factors)
    return {"balance": balance, "ms": float(cost.max(1).values.sum()) / 1e6}
