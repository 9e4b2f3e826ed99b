"""N ranks simulated on one device for packed documents and sliding windows: the engine's executor
on a LocalRing, timed (:mod:`.sim`).

The masked counterpart of :func:`.sim.simulate`: every layout gets its own view of one packed row
(:func:`.docs.workload`; ``zigzag`` pads each document to a multiple of ``2N``), its ranks' masked
:class:`~striped_sp.plan.ring_plan.RingPlan` are built once as :class:`~striped_sp.engine.request.RingRequest`
builds them (the varlen programs compiled and placed), and every (rank, round) of the executor is
run and timed (median over ``reps``); a round lasts as long as its slowest rank (or the transfer,
when a link bandwidth is given).  The single-device baseline runs the whole row on a ring of one.
"""

from __future__ import annotations

from ..engine.request import RingRequest
from .common import progress
from .docs import workload
from .report import plan_report
from .sim import (PASSES, Bar, SimConfig, random_inputs, reference_calls, reference_seconds, ring_calls, ring_plans,
                  sim_setup, time_rings)

__all__ = ["simulate_masked", "masked_request"]


def masked_request(layout: str, work, docs: str | None, window: int | None) -> RingRequest:
    """The request of ``layout`` on a workload's row: its (padded) documents and window."""
    return RingRequest(None, layout=layout, cu_seqlens=list(work.mask.bounds) if docs else None,
                       window_size=(window, 0) if window else None)


def simulate_masked(cfg: SimConfig, tokens_per_rank: list[int], docs: str | None, window: int | None,
                    seed: int = 0) -> list[dict]:
    """JSON records ``{"layout", "world_size", "seq_len", "tokens_per_rank", "docs", "window",
    "padding_tokens", "pass", "critical_path_ms", "speedup_vs_contiguous", "speedup_vs_zigzag",
    "efficiency"}`` for every (N, tokens per rank, pass, layout)."""
    gen, kernel = sim_setup(cfg)
    points = [(n, t) for n in cfg.world_sizes for t in tokens_per_rank]
    results = {}
    for n_ranks, tpr in progress(points, total=len(points), desc="sim", enabled=cfg.progress):
        works = {lay: workload(lay, n_ranks, tpr, docs, window, seed) for lay in cfg.layouts}
        rings = {lay: (ring_plans(cfg, masked_request(lay, w, docs, window), n_ranks, w.local_len, kernel),
                       random_inputs(cfg, w.local_len, gen))
                 for lay, w in works.items()}
        # the reference: the whole row of the first layout that pads nothing
        ref_work = next((w for lay, w in works.items() if lay != "zigzag"), None) if cfg.reference else None
        bar = Bar(ring_calls(cfg, len(rings)) + (reference_calls(cfg) if ref_work else 0),
                  f"N={n_ranks} tokens/rank={tpr}" + (" + one-device reference" if ref_work else ""), cfg.progress)
        for lay, crit in time_rings(cfg, rings, bar).items():
            results[(n_ranks, tpr, lay)] = (crit, works[lay])
        del rings
        ref = None
        if ref_work is not None:
            ref = reference_seconds(cfg, masked_request("contiguous", ref_work, docs, window),
                                    ref_work.mask.seq_len, kernel, gen, bar)
        bar.close()
        results[(n_ranks, tpr, "_ref")] = ref
    records = []
    for n_ranks, tpr in points:
        ref = results[(n_ranks, tpr, "_ref")]
        for p in PASSES:
            base = results.get((n_ranks, tpr, "contiguous"))
            zig = results.get((n_ranks, tpr, "zigzag"))
            for lay in cfg.layouts:
                crit, work = results[(n_ranks, tpr, lay)]
                c = crit[p]
                records.append({
                    "layout": lay, "world_size": n_ranks, "seq_len": n_ranks * tpr, "tokens_per_rank": tpr,
                    "docs": docs, "window": window or 0, "padding_tokens": work.padding_tokens,
                    "documents": len(work.mask.bounds) - 1, "pass": p, "critical_path_ms": c * 1e3,
                    "speedup_vs_contiguous": base[0][p] / c if base else None,
                    "speedup_vs_zigzag": zig[0][p] / c if zig else None,
                    "efficiency": ref[p] / n_ranks / c if ref else None,
                    **_plan_fields(lay, work, cfg, crit),
                })
    return records


def _plan_fields(lay: str, work, cfg: SimConfig, crit: dict) -> dict:
    """:func:`.report.plan_report` and, beside its prediction, the measured forward critical path."""
    fields = plan_report(lay, work.mask.bounds, work.world_size, work.mask.left >= 0, cfg.heads)
    return {**fields, "measured_forward_ms": crit["forward"] * 1e3} if fields else {}
