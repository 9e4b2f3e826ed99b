"""Where a striped layout puts each document of a packed row: striped over every rank, or whole.

Striping cuts a document of ``L`` tokens into ``N`` pieces of ``L / N`` tokens, and every ring
block meets a piece of every striped document: balanced, but small pieces cost more per score
entry than large ones.  A document short enough can instead stay whole on one rank, where its
attention runs in one piece, at the ring's first step, with no transfer.  This module decides:

* which documents stay whole (``doc_placement``: ``"split"`` none, an int ``L`` those of at most
  ``L`` tokens, ``"auto"`` the length the cost model predicts fastest, :func:`choose_whole_max`);
* where each whole document goes: a greedy balancing solver (largest cost first, to the rank with
  the least work that still has room), so that every rank ends with exactly ``S / N`` tokens; a
  document that fits nowhere whole is cut into contiguous pieces on the ranks with room left;
* how the other documents are striped: concatenated in row order into one sub-row, dealt token by
  token (``stripe_size = 1``: a run of step ``N`` per document and rank) or in stripes of
  ``stripe_size`` tokens (stripe ``g`` to rank ``g mod N``).

The result, per rank, is a table of runs ``(local_start, first_position, count, step)``
(:meth:`striped_sp.layouts.Layout.run_table`): striped runs first, then the pieces of cut
documents, then whole documents.  It is a pure function of the boundaries, ``N``, the stripe size
and the policy, so every rank, the data loader and the ring compute the same placement.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers

import torch

__all__ = ["CostModel", "COST_MODELS", "check_placement", "placed_runs", "choose_whole_max", "predicted_ms"]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Predicted time of one attention kernel call (forward, per head), in nanoseconds:
    ``ns_per_entry * entries * (1 + small_rows / rows) + call_ns``, where a causal call of ``m``
    rows computes ``m * min(m, m / 2 + causal_waste)`` entries (the kernel skips masked keys only
    in tiles, wasting about ``causal_waste`` entries per row on the diagonal)."""

    name: str
    ns_per_entry: float
    small_rows: float
    causal_waste: float
    call_ns: float
    measured: bool

    def call(self, rows: float, keys: float, causal: bool) -> float:
        if rows <= 0 or keys <= 0:
            return 0.0
        entries = rows * min(keys, rows / 2 + self.causal_waste) if causal else rows * keys
        return self.ns_per_entry * entries * (1 + self.small_rows / rows) + self.call_ns


COST_MODELS = {
    # measured here: PyTorch's CPU flash op, fp32, head_dim 64, one thread (docs/benchmarks.md, section 10)
    "cpu": CostModel("cpu", 3.9, 60.0, 256.0, 20_000.0, True),
    # a prediction, not a measurement: flash-attn 2/3 style tiles of 128 rows on a GPU
    "flash_attn": CostModel("flash_attn", 0.01, 128.0, 64.0, 5_000.0, False),
}


def check_placement(doc_placement):
    """``"split"``, ``"auto"`` or a positive int (the longest document kept whole); else ``ValueError``."""
    if doc_placement in ("split", "auto"):
        return doc_placement
    if isinstance(doc_placement, numbers.Integral) and not isinstance(doc_placement, bool) and doc_placement >= 1:
        return int(doc_placement)
    raise ValueError(f"doc_placement={doc_placement!r} must be 'split', 'auto' or a positive int "
                     "(the longest document kept whole on one rank)")


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


def _assign_whole(bounds, whole: list[int], capacity: list[int], model: CostModel):
    """Greedy: largest cost first, each to the rank with the least work that has room; a document
    that fits nowhere whole is cut into contiguous pieces over the ranks with the most room.
    Returns per rank ``[(first_position, count)]`` (cut pieces first) and the predicted work."""
    n = len(capacity)
    room = list(capacity)
    work = [0.0] * n
    cut = [[] for _ in range(n)]
    kept = [[] for _ in range(n)]
    cost = {d: model.call(bounds[d + 1] - bounds[d], bounds[d + 1] - bounds[d], True) for d in whole}
    for d in sorted(whole, key=lambda d: (-cost[d], d)):
        length = bounds[d + 1] - bounds[d]
        fits = [r for r in range(n) if room[r] >= length]
        if fits:
            r = min(fits, key=lambda r: (work[r], r))
            kept[r].append((bounds[d], length))
            room[r] -= length
            work[r] += cost[d]
            continue
        pos = bounds[d]
        for r in sorted(range(n), key=lambda r: (-room[r], r)):
            take = min(room[r], bounds[d + 1] - pos)
            if take <= 0:
                continue
            cut[r].append((pos, take))
            room[r] -= take
            work[r] += cost[d] * take / length
            pos += take
            if pos == bounds[d + 1]:
                break
    return [c + sorted(k) for c, k in zip(cut, kept)], work


def _place(bounds: tuple, world_size: int, stripe: int, whole_max: int, model: CostModel):
    """``(runs per rank, predicted step-0 work per rank, predicted work of every other step)``."""
    seq_len = bounds[-1]
    local = seq_len // world_size
    lengths = _lengths(bounds)
    whole = [d for d, n in enumerate(lengths) if n <= min(whole_max, local)]
    whole_set = set(whole)
    striped = [d for d in range(len(lengths)) if d not in whole_set]
    striped_runs = _striped_runs(bounds, striped, world_size, stripe)
    counts = [sum(c for _, c, _ in runs) for runs in striped_runs]
    capacity = [local - c for c in counts]
    if min(capacity) < 0 or (not whole and max(capacity) > 0):
        raise ValueError(
            f"stripe_size={stripe}: the striped documents ({sum(counts)} tokens) do not fall evenly on "
            f"{world_size} ranks of {local} tokens (per rank {counts}); use a stripe size that divides "
            f"the row by world_size * stripe_size, or doc_placement='auto' to fill the ranks with whole documents")
    placed, work = _assign_whole(bounds, whole, capacity, model)
    # the striped documents' work: every rank, every step, one piece of each (a model, not the plan)
    per_step = sum(model.call(lengths[d] / world_size, lengths[d] / world_size, True) for d in striped)
    tables = []
    for r in range(world_size):
        rows = [(p, c, s) for p, c, s in striped_runs[r]] + [(p, c, 1) for p, c in placed[r]]
        counts_r = torch.tensor([c for _, c, _ in rows], dtype=torch.int64)
        local_start = torch.cumsum(counts_r, 0) - counts_r
        table = torch.tensor([[ls, p, c, s] for ls, (p, c, s) in zip(local_start.tolist(), rows)], dtype=torch.int64)
        tables.append(table.view(-1, 4))
    return tables, work, per_step


def predicted_ms(bounds, world_size: int, stripe: int, whole_max: int, model: CostModel | str = "cpu",
                 heads: int = 1) -> float:
    """The cost model's forward critical path (ms, ``heads`` heads) of a placement: the slowest
    rank's first step (its whole documents and striped pieces) plus ``N - 1`` striped steps."""
    model = COST_MODELS[model] if isinstance(model, str) else model
    _, work, per_step = _place(tuple(bounds), world_size, stripe, whole_max, model)
    return (max(work) + world_size * per_step) * heads / 1e6


def choose_whole_max(bounds, world_size: int, stripe: int = 1, model: CostModel | str = "cpu") -> int:
    """``doc_placement="auto"``: the longest-whole-document length (among powers of two up to the
    tokens per rank, and 0) with the smallest :func:`predicted_ms`; infeasible candidates skipped."""
    bounds = tuple(bounds)
    local = bounds[-1] // world_size
    candidates, c = [0], 16
    while c < local:
        candidates.append(c)
        c *= 2
    candidates.append(local)
    best = None
    for cand in candidates:
        try:
            t = predicted_ms(bounds, world_size, stripe, cand, model)
        except ValueError:
            continue
        if best is None or t < best[0]:
            best = (t, cand)
    if best is None:
        raise ValueError(f"no document placement fills {world_size} ranks evenly with stripe_size={stripe}")
    return best[1]


@functools.lru_cache(maxsize=64)
def placed_runs(bounds: tuple, world_size: int, stripe: int, doc_placement) -> list[torch.Tensor]:
    """Per rank, the int64 run table ``[runs, 4]`` (local start, first position, count, step) of a
    packed row with boundaries ``bounds`` (cached).  ``ValueError`` when the stripes cannot fill
    the ranks evenly."""
    if doc_placement == "split":
        whole_max = 0
    elif doc_placement == "auto":
        whole_max = choose_whole_max(bounds, world_size, stripe)
    else:
        whole_max = doc_placement
    return _place(bounds, world_size, stripe, whole_max, COST_MODELS["cpu"])[0]
