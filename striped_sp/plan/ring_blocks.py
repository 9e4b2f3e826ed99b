"""Every block of one rank's ring at once: the varlen calls of all its steps from one tensor pass.

A ring has ``N`` blocks per rank (queries of ``rank`` against the keys of each ``source``), and at
1M tokens on 64 ranks a per-block planner's fixed cost (some hundred small tensor ops) would
dominate a batch's plan.  Here the pieces of every rank come from one pass over the concatenated
run tables, and the pairs of every step (query piece x key piece of the same document on that
step's source) from one ``searchsorted`` over ``(source, document)`` keys; only the final cut
into :class:`Segments` loops, once per call.  :func:`striped_sp.plan.masks.block_plan` (one
block) and :func:`~striped_sp.plan.masks.ring_plans` (a ring) both run it; tests/unit/test_masks.py
checks their coverage against the global mask, tests/unit/test_ring_blocks.py a ring's steps
built together against the same steps built one by one.
"""

from __future__ import annotations

import torch

from ..kernels.segments import INF, Segments

__all__ = ["all_pieces", "ring_blocks", "all_shared_rows"]


def _ceil_div(a: torch.Tensor, b) -> torch.Tensor:
    return -torch.div(-a, b, rounding_mode="floor")


def _all_runs(layout, spec, world_size: int):
    """Every rank's non-empty runs (local start, first position, count, step) and their ranks."""
    runs, sizes = layout.all_run_tables(spec.seq_len, world_size, spec.bounds)
    owner = torch.repeat_interleave(torch.arange(world_size), sizes)
    live = runs[:, 2] > 0
    return runs[live], owner[live]


def all_pieces(layout, spec, world_size: int):
    """Every rank's runs cut at document bounds: int64 ``(rank, doc, local, pos, count, step)``,
    sorted by rank, then document, then local start.  The pieces of one document share one step
    (a document is striped, or whole, everywhere)."""
    runs, owner = _all_runs(layout, spec, world_size)
    local0, pos0, count, stride = runs.t().contiguous().unbind(0)
    starts = torch.tensor(spec.bounds[:-1], dtype=torch.int64)
    ends = torch.tensor(spec.bounds[1:], dtype=torch.int64)
    d0 = torch.searchsorted(starts, pos0, right=True) - 1
    d1 = torch.searchsorted(starts, pos0 + (count - 1) * stride, right=True) - 1
    if bool((d0 == d1).all()):  # every run inside one document (zigzag, per-document stripes): no cut
        width = int(local0.max()) + 1 if local0.numel() else 1
        key = (owner * len(spec.bounds) + d0) * width + local0
        if key.numel() < 2 or bool((key[1:] >= key[:-1]).all()):  # and already in order
            return owner, d0, local0, pos0, count, stride
    reps = d1 - d0 + 1
    total = int(reps.sum())
    run = torch.repeat_interleave(torch.arange(runs.size(0)), reps, output_size=total)
    doc = d0[run] + (torch.arange(total) - (torch.cumsum(reps, 0) - reps)[run])
    step = stride[run]
    a0 = torch.clamp(_ceil_div(starts[doc] - pos0[run], step), min=0)
    a1 = torch.minimum(_ceil_div(ends[doc] - pos0[run], step), count[run])
    keep = a1 > a0
    a0, a1, doc, run, step = a0[keep], a1[keep], doc[keep], run[keep], step[keep]
    local = local0[run] + a0
    rank = owner[run]
    width = int(local.max()) + 1 if local.numel() else 1
    order = torch.argsort((rank * len(spec.bounds) + doc) * width + local)
    return (rank[order], doc[order], local[order], (pos0[run] + a0 * step)[order], (a1 - a0)[order],
            step[order])


def ring_blocks(spec, world_size: int, rank: int, steps, pieces) -> dict:
    """``{step: [Segments, ...]}`` for ``steps`` (the ring steps to build; source of step ``t``:
    ``(rank - t) % world_size``) from :func:`all_pieces`; a step with nothing visible maps to
    ``[]``.  A query piece's pairs that :func:`_coalesce` joins are one segment; the calls of a
    step are ordered by a segment's place among its query piece's (0, 1, ...), segments within a
    call by query piece."""
    out = {t: [] for t in steps}
    owner, doc, local, pos, count, stride = pieces
    mine = owner == rank
    qd, ql, qp, qn, qs = doc[mine], local[mine], pos[mine], count[mine], stride[mine]
    if not steps or qd.numel() == 0:
        return out
    docs = len(spec.bounds)
    t_all = torch.tensor(list(steps), dtype=torch.int64)
    source = (rank - t_all) % world_size
    kkey = owner * docs + doc  # sorted: pieces are ordered by rank, then document
    qkey = (source.unsqueeze(1) * docs + qd.unsqueeze(0)).flatten()  # [steps * Q]
    first = torch.searchsorted(kkey, qkey)
    reps = torch.searchsorted(kkey, qkey, right=True) - first
    total = int(reps.sum())
    pair = torch.repeat_interleave(torch.arange(qkey.numel()), reps, output_size=total)
    nth = torch.arange(total) - (torch.cumsum(reps, 0) - reps)[pair]
    ki = first[pair] + nth
    qi = pair % qd.numel()
    step_of = qs[qi]
    dist = qp[qi] - pos[ki]
    hi = (torch.div(dist + spec.right, step_of, rounding_mode="floor") if spec.right >= 0
          else torch.full_like(dist, INF))
    lo = _ceil_div(dist - spec.left, step_of) if spec.left >= 0 else torch.full_like(dist, -INF)
    nq, nk = qn[qi], count[ki]
    a0 = torch.clamp(-hi, min=0)
    a1 = torch.minimum(nq - 1, nk - 1 - lo)
    keep = (a0 <= a1) & (lo <= hi)
    b0 = torch.clamp(a0 + lo, min=0)
    b1 = torch.minimum(nk - 1, a1 + hi)
    lq, lk = a1 - a0 + 1, b1 - b0 + 1
    lo2, hi2 = lo + a0 - b0, hi + a0 - b0
    q_start, k_start = ql[qi] + a0, local[ki] + b0
    sel = keep.nonzero().flatten()  # the live pairs, in (step, query piece, key piece) order
    if sel.numel() == 0:
        return out
    tq, lq, lk, lo2, hi2, q_start, k_start = (x[sel] for x in (pair, lq, lk, lo2, hi2, q_start, k_start))
    tq, lq, lk, lo2, hi2, q_start, k_start, nth = _coalesce(tq, lq, lk, lo2, hi2, q_start, k_start,
                                                             left_open=spec.left < 0)
    ti = tq // qd.numel()
    sh = lk - lq
    wl = torch.where(lq - 1 + lo2 <= 0, -1, sh - lo2)
    # unbounded on the right when the first row sees the last key; an exact causal edge stays 0
    wr = torch.where((hi2 >= lk - 1) & (hi2 != sh), -1, hi2 - sh)
    # the calls: one per (step, nth), in that order, each holding its pairs in query-piece order
    width = int(nth.max()) + 1
    call = ti * width + nth
    order = torch.argsort(call, stable=True)
    lq, lk, wl, wr, q_start, k_start = (x[order] for x in (lq, lk, wl, wr, q_start, k_start))
    calls, sizes = torch.unique_consecutive(call[order], return_counts=True)
    cq, ck = torch.cumsum(lq, 0), torch.cumsum(lk, 0)
    zero = torch.zeros(1, dtype=torch.int64)
    entries = Segments(torch.cat([zero, cq]), torch.cat([zero, ck]), wl, wr, q_start, k_start).segment_entries()
    at = 0
    t_list = t_all.tolist()
    for key, n in zip(calls.tolist(), sizes.tolist()):
        part = slice(at, at + n)
        base_q, base_k = (cq[at - 1], ck[at - 1]) if at else (zero[0], zero[0])
        segs = Segments(torch.cat([zero, cq[part] - base_q]), torch.cat([zero, ck[part] - base_k]), wl[part],
                        wr[part], q_start[part], k_start[part])
        segs.__dict__["_entries"] = entries[part]  # Segments.segment_entries, already counted
        out[t_list[key // width]].append(segs)
        at += n
    return out



def _coalesce(tq, lq, lk, lo, hi, q_start, k_start, left_open: bool):
    """One query piece's pairs whose key rows follow each other, every one but the last seen
    whole by every query row (the key stripes of one document before a query stripe, or zigzag's
    two chunks), and that keep the same query rows, become one segment: its keys the run's keys,
    its band the last pair's shifted by the keys before it.  Only without a left window (a left
    bound would cut the earlier keys).  Returns the pairs (run by run) and each one's place
    among its query piece's (``nth``: 0, 1, ...): the calls it goes to."""
    n = tq.numel()
    joins = torch.zeros(n, dtype=torch.bool)  # pair e joins the run of pair e - 1
    if left_open and n > 1:
        joins[1:] = ((tq[1:] == tq[:-1]) & (q_start[1:] == q_start[:-1]) & (lq[1:] == lq[:-1])
                     & (k_start[1:] == k_start[:-1] + lk[:-1]) & (hi[:-1] >= lk[:-1] - 1))
    run = torch.cumsum(~joins, 0) - 1
    runs = int(run[-1]) + 1
    first = torch.nonzero(~joins).flatten()
    last = torch.cat([first[1:] - 1, torch.tensor([n - 1])])
    keys = torch.zeros(runs, dtype=torch.int64).index_add_(0, run, lk)
    before = keys - lk[last]  # the keys ahead of the run's last pair
    tq = tq[first]
    new_piece = torch.ones(runs, dtype=torch.bool)
    new_piece[1:] = tq[1:] != tq[:-1]
    group_first = torch.cummax(torch.where(new_piece, torch.arange(runs), torch.zeros(runs, dtype=torch.int64)), 0)[0]
    nth = torch.arange(runs) - group_first
    # the last pair's band, shifted by the keys before it (their lower bound is open: they are seen whole)
    return tq, lq[first], keys, lo[last] + before, hi[last] + before, q_start[first], k_start[first], nth


def all_shared_rows(layout, spec, world_size: int) -> tuple:
    """:func:`~striped_sp.plan.masks.shared_rows` of every rank: its local length less the
    documents that close its local order and lie wholly on it (in one run of step 1, or of one
    token), whose keys no other rank's queries see."""
    runs, owner = _all_runs(layout, spec, world_size)
    first, count, step = runs[:, 1].contiguous(), runs[:, 2], runs[:, 3]
    starts = torch.tensor(spec.bounds[:-1], dtype=torch.int64)
    lengths = torch.tensor(spec.bounds[1:], dtype=torch.int64) - starts
    d = torch.searchsorted(starts, first, right=True) - 1
    whole = (starts[d] == first) & (lengths[d] == count) & ((count == 1) | (step == 1))
    # a rank's private rows: its runs after its last run that is not a whole document
    place = torch.arange(runs.size(0))
    last_open = torch.full((world_size,), -1, dtype=torch.int64).scatter_reduce(
        0, owner[~whole], place[~whole], "amax")
    private = torch.zeros(world_size, dtype=torch.int64).index_add_(
        0, owner, torch.where(place > last_open[owner], count, torch.zeros_like(count)))
    return tuple((spec.seq_len // world_size - private).tolist())
