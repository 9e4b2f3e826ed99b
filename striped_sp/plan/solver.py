"""The balancing solver of whole-document placement: one greedy rule for every layout that keeps
documents whole (:mod:`striped_sp.plan.placement`, :mod:`striped_sp.plan.doc_stripes`).

The rule (:func:`assign_greedy`): documents most score entries first, each to the rank with the
fewest entries among those with room for it whole.  It runs on two heaps of ranks, so a batch
costs ``O(docs log N)``: ranks that may have room, keyed by ``(entries, tokens placed, rank)``,
and ranks found too full for the current document, keyed by room; documents come longest first,
so a rank's room only has to be checked against the current length, and a full rank returns to
the first heap only once the documents get short enough for it.  :class:`Rerun` keeps a run's
steps so that a retry with less room per rank replays only from the first step whose rank no
longer has room (every step before it chooses exactly as before)."""

from __future__ import annotations

import bisect
import heapq
import operator

__all__ = ["assign_greedy", "Rerun"]


def _steps(lengths: list[int], room: list[int], placed: list[int], work: list[int], start: int = 0,
           stop_above: int | None = None) -> tuple[list[int], int]:
    """The greedy over ``lengths[start:]`` (non-increasing) from the per-rank state ``room``,
    ``placed``, ``work`` (updated in place).  Returns ``(ranks, stop)``: the rank of each step
    (-1: fits nowhere) and where the run stopped: at the first step that fits nowhere with more
    than ``stop_above`` tokens, else ``len(lengths)``."""
    n = len(room)
    ranks: list[int] = []
    if not n:
        return [-1] * (len(lengths) - start), len(lengths)
    # (entries, placed, rank) as one int: placed < scale, rank < n
    scale = max(placed) + max(0, max(room)) + 1
    ready = [(work[r] * scale + placed[r]) * n + r for r in range(n)]
    heapq.heapify(ready)
    full: list[int] = []  # -room * n + rank: the roomiest first
    push, pop, replace = heapq.heappush, heapq.heappop, heapq.heapreplace
    for i in range(start, len(lengths)):
        length = lengths[i]
        while full and room[full[0] % n] >= length:
            r = pop(full) % n
            push(ready, (work[r] * scale + placed[r]) * n + r)
        while ready:
            r = ready[0] % n
            if room[r] >= length:
                break
            pop(ready)
            push(full, -room[r] * n + r)
        else:
            if stop_above is not None and length > stop_above:
                return ranks, i
            ranks.append(-1)
            continue
        room[r] -= length
        placed[r] += length
        work[r] += length * (length + 1) // 2
        replace(ready, (work[r] * scale + placed[r]) * n + r)
        ranks.append(r)
    return ranks, len(lengths)


def assign_greedy(lengths, docs, room: list[int]):
    """Documents ``docs`` (indices into ``lengths``), most score entries first (ties: the lower
    index), each to the rank with the fewest entries so far among those with room for it whole
    (ties: the fewest tokens placed, then the lower rank).  ``room``: tokens each rank can still
    take (updated in place).  Returns ``(kept, unfit, work)``: per rank the documents it keeps, the
    documents that fit nowhere, per rank its score entries."""
    n = len(room)
    order = sorted(docs, key=lambda d: (-lengths[d], d))
    work, placed = [0] * n, [0] * n
    ranks, _ = _steps([lengths[d] for d in order], room, placed, work)
    kept: list[list[int]] = [[] for _ in range(n)]
    unfit = []
    for d, r in zip(order, ranks):
        if r < 0:
            unfit.append(d)
        else:
            kept[r].append(d)
    return kept, unfit, work


class Rerun:
    """:func:`assign_greedy` retried on the same documents, with fewer documents or less room
    per rank each time.  ``docs``: in the greedy's order (most entries first, ties lower index).

    A retry whose rooms are no larger than the last run's makes the same choice at every step
    until the first one whose rank no longer has room for its document (the ranks with room are
    fewer, and the one chosen before, the least loaded of more, is still among them): it replays
    only from there.  Removing a document replays from its step."""

    def __init__(self, docs: list[int], lengths, n_ranks: int):
        self.docs = list(docs)
        self.lengths = [lengths[d] for d in self.docs]
        self.n = n_ranks
        self.ranks: list[int] = []  # the valid prefix: rank per step (-1: fit nowhere)
        # per rank: its steps, and its tokens and entries placed after each; the totals so far
        self.steps = [[] for _ in range(n_ranks)]
        self.placed = [[] for _ in range(n_ranks)]
        self.work = [[] for _ in range(n_ranks)]
        self.total_placed = [0] * n_ranks
        self.total_work = [0] * n_ranks
        self.capacity = None

    def _truncate(self, keep: int) -> None:
        if keep >= len(self.ranks):
            return
        del self.ranks[keep:]
        for r in range(self.n):
            steps = self.steps[r]
            if steps and steps[-1] >= keep:
                j = bisect.bisect_left(steps, keep)
                del steps[j:], self.placed[r][j:], self.work[r][j:]
                self.total_placed[r] = self.placed[r][-1] if j else 0
                self.total_work[r] = self.work[r][-1] if j else 0

    def _keep(self, capacity: list[int]) -> int:
        """Cuts the recorded prefix to the steps that a run with ``capacity`` repeats."""
        keep = len(self.ranks)
        if self.capacity is None or any(map(operator.gt, capacity, self.capacity)):
            keep = 0
        elif -1 in self.ranks:
            keep = self.ranks.index(-1)
        if keep:
            for r, over in enumerate(map(operator.gt, self.total_placed, capacity)):
                if over:  # its first step past the room
                    j = bisect.bisect_right(self.placed[r], capacity[r])
                    keep = min(keep, self.steps[r][j])
        self._truncate(keep)
        return keep

    def run(self, capacity: list[int], stop_above: int | None = None) -> int:
        """The greedy with ``capacity`` tokens per rank; returns where it stopped: the first
        document that fits nowhere with more than ``stop_above`` tokens, else ``len(docs)``
        (:attr:`ranks` then holds every step)."""
        start = self._keep(capacity)
        self.capacity = list(capacity)
        room = list(map(operator.sub, capacity, self.total_placed))
        lengths = self.lengths
        if start < len(lengths) and stop_above is not None and lengths[start] > stop_above \
                and lengths[start] > max(room, default=-1):
            return start  # the next document fits nowhere: no need to build the heaps
        placed, work = list(self.total_placed), list(self.total_work)
        ranks, stop = _steps(lengths, room, placed, work, start, stop_above)
        for i, r in enumerate(ranks, start):
            if r >= 0:
                length = lengths[i]
                self.steps[r].append(i)
                self.placed[r].append((self.placed[r][-1] if self.placed[r] else 0) + length)
                self.work[r].append((self.work[r][-1] if self.work[r] else 0) + length * (length + 1) // 2)
        self.total_placed, self.total_work = placed, work
        self.ranks += ranks
        return stop

    def remove(self, steps) -> None:
        """Drops the documents at ``steps`` (positions in the order); the steps from the first of
        them on are run again next time."""
        steps = sorted(set(steps), reverse=True)
        if steps:
            self._truncate(steps[-1])
        for i in steps:
            del self.docs[i], self.lengths[i]

    def result(self):
        """``(kept, unfit, work)`` of the last run, as :func:`assign_greedy` returns them (after
        a run that went through every document)."""
        kept: list[list[int]] = [[] for _ in range(self.n)]
        unfit = []
        for d, r in zip(self.docs, self.ranks):
            if r < 0:
                unfit.append(d)
            else:
                kept[r].append(d)
        return kept, unfit, list(self.total_work)
