"""The work model: attention score entries per rank and ring step, from the layouts' own plans.

At ring step ``t`` rank ``r`` holds the key/value block of rank ``(r - t) mod N`` and runs the
kernel calls of ``layout.plan(r, source, N, n)``.  Counting the score entries of those calls gives
each rank's causal work per step.  A ring step ends when its slowest rank ends, so the critical
path is the sum over steps of the largest entry count; the ideal is the total causal work of the
whole sequence, ``S (S + 1) / 2``, spread evenly over ``N`` ranks.
"""

from __future__ import annotations

from ..plan.layouts import get_layout
from ..plan.masks import ring_plans
from .docs import workload
from .report import plan_report

__all__ = ["step_entries", "masked_step_entries", "score_entries", "critical_path_over_ideal",
           "balance_records", "masked_balance_records", "mixed_balance_records"]


def step_entries(layout: str, world_size: int, local_len: int, causal: bool = True) -> list[list[int]]:
    """``entries[t][r]``: score entries (per batch and head) that rank ``r`` computes at step ``t``."""
    lay = get_layout(layout)
    lay.check_local_len(local_len)
    return [
        [
            sum(call.score_entries(local_len)
                for call in lay.plan(r, (r - t) % world_size, world_size, local_len, causal))
            for r in range(world_size)
        ]
        for t in range(world_size)
    ]


def score_entries(layout: str, world_size: int, rank: int, local_len: int, causal: bool = True) -> int:
    """Score entries per (batch, head) that ``rank`` computes over a whole ring pass."""
    return sum(row[rank] for row in step_entries(layout, world_size, local_len, causal))


def critical_path_over_ideal(layout: str, world_size: int, local_len: int) -> float:
    """Sum over steps of the slowest rank's entries, over ``S (S + 1) / 2 / N`` (causal)."""
    entries = step_entries(layout, world_size, local_len)
    critical = sum(max(row) for row in entries)
    seq = world_size * local_len
    ideal = seq * (seq + 1) / 2 / world_size
    return critical / ideal


def balance_records(layouts, world_sizes, local_len: int) -> list[dict]:
    """JSON records ``{"layout", "world_size", "critical_path_over_ideal"}``."""
    return [
        {"layout": lay, "world_size": n, "critical_path_over_ideal": critical_path_over_ideal(lay, n, local_len)}
        for n in world_sizes
        for lay in layouts
    ]


def masked_step_entries(work) -> list[list[int]]:
    """``entries[t][r]`` for a packed / windowed row (a :class:`~striped_sp.bench.docs.Workload`)."""
    lay, n = get_layout(work.layout), work.world_size
    per_rank = [[sum(c.entries for c in step) for step in ring_plans(lay, work.mask, n, r)] for r in range(n)]
    return [[per_rank[r][t] for r in range(n)] for t in range(n)]


def masked_balance_records(layouts, world_sizes, tokens_per_rank: int, docs: str | None,
                           window: int | None, seed: int = 0) -> list[dict]:
    """JSON records with ``docs``, ``window``, ``padding_tokens`` and ``critical_path_over_ideal``
    (ideal = visible score entries of the unpadded row / N); a striped layout with parameters adds
    :func:`.report.plan_report`'s ``plan``, ``plan_balance`` and ``predicted_forward_ms`` (per head)."""
    records = []
    for n in world_sizes:
        for lay in layouts:
            work = workload(lay, n, tokens_per_rank, docs, window, seed)
            entries = masked_step_entries(work)
            critical = sum(max(row) for row in entries)
            records.append({
                "layout": lay, "world_size": n, "tokens_per_rank": tokens_per_rank, "docs": docs,
                "window": window or 0, "padding_tokens": work.padding_tokens,
                "documents": len(work.mask.bounds) - 1, "critical_path_over_ideal": critical / work.ideal_entries,
                "critical_entries": critical, "ideal_entries": work.ideal_entries,
                # a striped layout with parameters: the placement chosen and the cost model's forward per head
                **plan_report(lay, workload("striped", n, tokens_per_rank, docs, None).mask.bounds, n,
                              bool(window), 1),
            })
    return records


def mixed_balance_records(layouts, world_sizes, tokens_per_rank: int, docs: str | None, window: int,
                          ks, seed: int = 0) -> list[dict]:
    """A mixed local/global model's balance (:mod:`.mixed`: one block of ``K`` layers, ``K - 1`` with
    the window and one global causal layer, sharing the row's layout): per layout, N and K the window
    layer's and the global layer's critical path over ideal (``window_layer_balance``,
    ``global_layer_balance``) and the block's, ``critical_path_over_ideal`` = ``((K - 1) * critical_w +
    critical_g) / ((K - 1) * ideal_w + ideal_g)`` in score entries; the window record's other fields
    (its plan line) kept, the global layer's plan balance as ``global_plan_balance``."""
    out = []
    for k in ks:
        for lay in layouts:
            for n in world_sizes:
                w, = masked_balance_records([lay], [n], tokens_per_rank, docs, window, seed)
                g, = masked_balance_records([lay], [n], tokens_per_rank, docs, None, seed)
                crit = (k - 1) * w["critical_entries"] + g["critical_entries"]
                ideal = (k - 1) * w["ideal_entries"] + g["ideal_entries"]
                out.append({**w, "global_every": k, "window_layer_balance": w["critical_path_over_ideal"],
                            "global_layer_balance": g["critical_path_over_ideal"],
                            "global_plan_balance": g.get("plan_balance"), "critical_path_over_ideal": crit / ideal})
    return out
