"""The balancing solver of whole-document placement: one greedy rule for every layout that keeps
documents whole (:mod:`striped_sp.plan.placement`, :mod:`striped_sp.plan.doc_stripes`)."""

from __future__ import annotations

__all__ = ["assign_greedy"]


def assign_greedy(lengths, docs, room: list[int]):
    """Documents ``docs`` (indices into ``lengths``), most score entries first (ties: the lower
    index), each to the rank with the fewest entries so far among those with room for it whole
    (ties: the fewest tokens placed, then the lower rank).  ``room``: tokens each rank can still
    take (updated in place).  Returns ``(kept, unfit, work)``: per rank the documents it keeps, the
    documents that fit nowhere, per rank its score entries."""
    n = len(room)
    work, placed = [0] * n, [0] * n
    kept: list[list[int]] = [[] for _ in range(n)]
    unfit = []
    for d in sorted(docs, key=lambda d: (-lengths[d], d)):
        length = lengths[d]
        fits = [r for r in range(n) if room[r] >= length]
        if not fits:
            unfit.append(d)
            continue
        r = min(fits, key=lambda r: (work[r], placed[r], r))
        kept[r].append(d)
        room[r] -= length
        placed[r] += length
        work[r] += length * (length + 1) // 2
    return kept, unfit, work
