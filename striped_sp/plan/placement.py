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
from .solver import assign_greedy

__all__ = ["check_placement", "check_stripe_size", "predict"]


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


def _striped_runs(bounds, striped: list[int], world_size: int, stripe: int) -> list[list[tuple]]:
    """Per rank, the runs ``(first_position, count, step)`` of the striped documents (indices
    ``striped``), dealt in row order as one sub-row."""
    per_rank = [[] for _ in range(world_size)]
    offset = 0  # start of the document in the sub-row
    for d in striped:
        start, length = bounds[d], bounds[d + 1] - bounds[d]
        if stripe == 1:
            for r in range(world_size):
                t0 = (r - offset) % world_size
                if t0 < length:
                    per_rank[r].append((start + t0, (length - t0 + world_size - 1) // world_size, world_size))
        else:
            t = 0
            while t < length:  # the stripes (or stripe ends) that fall inside this document
                g = (offset + t) // stripe
                end = min(length, (g + 1) * stripe - offset)
                per_rank[g % world_size].append((start + t, end - t, 1))
                t = end
        offset += length
    return per_rank


def _entries(length: int) -> int:
    return length * (length + 1) // 2


def _assign_whole(bounds, whole: list[int], capacity: list[int], cut_max: int):
    """Whole documents by :func:`~striped_sp.plan.solver.assign_greedy`.  A document that fits
    nowhere whole is cut into contiguous pieces over the ranks with the most room if it has at
    most ``cut_max`` tokens (its cross-rank blocks stay small); longer ones are returned as
    ``unfit``.  Returns per rank ``[(first_position, count)]`` (cut pieces first), the entries per
    rank and the unfit documents."""
    n = len(capacity)
    lengths = {d: bounds[d + 1] - bounds[d] for d in whole}
    room = list(capacity)
    kept_docs, left, work = assign_greedy(lengths, whole, room)
    kept = [[(bounds[d], lengths[d]) for d in docs] for docs in kept_docs]
    small = [d for d in left if lengths[d] <= cut_max]
    unfit = [d for d in left if lengths[d] > cut_max]
    cut = [[] for _ in range(n)]
    for d in small:
        pos = bounds[d]
        for r in sorted(range(n), key=lambda r: (-room[r], r)):
            take = min(room[r], bounds[d + 1] - pos)
            if take <= 0:
                continue
            cut[r].append((pos, take))
            room[r] -= take
            work[r] += _entries(take)
            pos += take
            if pos == bounds[d + 1]:
                break
    return [c + sorted(k) for c, k in zip(cut, kept)], work, unfit


def _striped_capacity(bounds, striped, world_size, stripe, local):
    runs = _striped_runs(bounds, striped, world_size, stripe)
    return runs, [local - sum(c for _, c, _ in r) for r in runs]


def _place(bounds: tuple, world_size: int, stripe: int, whole_max: int):
    """``(run tables per rank, whole documents, striped documents, whole entries per rank)``.

    Documents of at most ``whole_max`` tokens start out whole; the striped ones fix each rank's
    room.  While a whole candidate is too long to fit (or to cut harmlessly: a cut document's
    cross-rank block lands on one rank at one step), the longest such one is striped instead and
    the rest placed again; after ``2N`` tries the leftovers are cut."""
    seq_len = bounds[-1]
    local = seq_len // world_size
    lengths = _lengths(bounds)
    cut_max = max(64, local // 64)
    whole = [d for d, n in enumerate(lengths) if n <= min(whole_max, local)]
    for attempt in range(2 * world_size + 1):
        if attempt == 2 * world_size:
            cut_max = local  # give up moving documents: cut what is left (predict counts the cost)
        whole_set = set(whole)
        striped = [d for d in range(len(lengths)) if d not in whole_set]
        striped_runs, capacity = _striped_capacity(bounds, striped, world_size, stripe, local)
        if min(capacity) < 0 or (not whole and max(capacity) > 0):
            raise ValueError(
                f"stripe_size={stripe}: the striped documents ({seq_len - sum(capacity)} tokens) do not fall "
                f"evenly on {world_size} ranks of {local} tokens (room left per rank {capacity}); use a stripe "
                "size that divides the row by world_size * stripe_size, or doc_placement='auto' to fill the "
                "ranks with whole documents")
        placed, entries, unfit = _assign_whole(bounds, whole, capacity, cut_max)
        if not unfit:
            break
        # the longest one is striped instead; the rooms shrink evenly and the rest is placed again
        drop = max(unfit, key=lambda d: (lengths[d], d))
        whole = [d for d in whole if d != drop]
    tables = []
    for r in range(world_size):
        rows = [(p, c, s) for p, c, s in striped_runs[r]] + [(p, c, 1) for p, c in placed[r]]
        counts_r = torch.tensor([c for _, c, _ in rows], dtype=torch.int64)
        local_start = torch.cumsum(counts_r, 0) - counts_r
        table = torch.tensor([[ls, p, c, s] for ls, (p, c, s) in zip(local_start.tolist(), rows)], dtype=torch.int64)
        tables.append(table.view(-1, 4))
    return tables, whole, striped, entries


def _whole_pieces(bounds: tuple, tables: list, whole: list) -> list[list[tuple[int, int]]]:
    """Per rank, ``(document, count)`` of the pieces of documents placed whole (or cut)."""
    whole = set(whole)
    per_rank = []
    for t in tables:
        rows = []
        for _, first, count, step in t.tolist():
            doc = bisect.bisect_right(bounds, first) - 1
            if step == 1 and doc in whole:
                rows.append((doc, count))
        per_rank.append(rows)
    return per_rank


def _cross_entries(pieces: list) -> int:
    """Score entries between the pieces of documents cut over several ranks."""
    by_doc: dict = {}
    for rows in pieces:
        for doc, count in rows:
            by_doc.setdefault(doc, []).append(count)
    total = 0
    for counts in by_doc.values():
        before = 0
        for c in counts:
            total += c * before
            before += c
    return total


def _piece(length: int, world_size: int, stripe: int) -> float:
    """Rows of the pieces a striped document of ``length`` tokens is cut into on one rank."""
    return length / world_size if stripe == 1 else min(stripe, length)


def predict(bounds, world_size: int, stripe: int, whole_max: int, model: CostModel | str | None = None) -> dict:
    """The model's view of a placement: ``balance`` (critical path over ideal in score entries:
    the slowest rank's whole documents plus an even share of the striped ones, over an even share
    of all) and ``ms``, its forward critical path per head in milliseconds (whole documents cost one
    causal call each on their rank; a striped document one piece per rank and ring step)."""
    model = model_named(model)
    bounds = tuple(bounds)
    if stripe == "doc":
        return _predict_doc(bounds, world_size, whole_max, model)
    tables, whole, striped, entries = _place(bounds, world_size, stripe, whole_max)
    pieces = _whole_pieces(bounds, tables, whole)
    lengths = _lengths(bounds)
    ideal = sum(_entries(n) for n in lengths) / world_size
    striped_share = sum(_entries(lengths[d]) for d in striped) / world_size
    # a document cut over ranks adds its cross blocks (piece x earlier pieces) to single steps of
    # single ranks: counted in full, as if they all fell on the slowest rank
    balance = (max(entries) + _cross_entries(pieces) + striped_share) / ideal
    whole_ns = [sum(model.call(c, c, True) for _, c in rows) for rows in pieces]
    per_step = 0.0
    for d in striped:
        m = _piece(lengths[d], world_size, stripe)
        per_step += model.call(m, m, True) * (lengths[d] / world_size / m) ** 2
    return {"balance": balance, "ms": (max(whole_ns) + world_size * per_step) / 1e6}


def _predict_doc(bounds: tuple, world_size: int, whole_max: int, model: CostModel) -> dict:
    """:func:`predict` for per-document stripes: the exact entries of every (step, rank) block."""
    _, kept, _, counts = doc_stripes.place(bounds, world_size, whole_max)
    entries = doc_stripes.step_entries(bounds, world_size, kept, counts)
    ideal = float(entries.sum()) / world_size
    balance = float(entries.max(1).values.sum()) / ideal if ideal else 1.0

    def call(rows, keys, causal):
        rows = torch.clamp(rows, min=1e-9)
        area = rows * torch.minimum(keys, rows / 2 + model.causal_waste) if causal else rows * keys
        ns = model.ns_per_entry * area * (1 + model.small_rows / rows) + model.call_ns
        return torch.where((rows >= 1) & (keys >= 1), ns, torch.zeros_like(ns))

    cost = doc_stripes.step_cost(bounds, world_size, kept, counts, lambda m: call(m, m, True),
                                 lambda q, k: call(q, k, False))
    return {"balance": balance, "ms": float(cost.max(1).values.sum()) / 1e6}
