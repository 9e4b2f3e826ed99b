"""N ranks simulated on one device for packed documents and sliding windows, with the real kernels.

The masked counterpart of :mod:`.sim`: every layout gets its own view of one packed row
(:func:`.docs.workload`; ``zigzag`` pads each document to a multiple of ``2N``), and each (rank,
step) runs exactly what :class:`striped_sp.engine.autograd._RingAttention` runs there: the block plan's
varlen calls (gather, ``kernel.forward_varlen``, the fp32 merge) and in backward
``kernel.backward_varlen`` with the dQ / dK / dV accumulation.  Plans differ from rank to rank,
so every distinct (rank, step) plan is timed (identical ones, frequent in a row of one document,
once); a step lasts as long as its slowest rank (or the transfer, when a
link bandwidth is given).  The single-device baseline runs the whole row as one varlen call.
"""

from __future__ import annotations

import torch

from ..engine.step import Accumulator as _Accumulator
from ..kernels import resolve_kernel
from ..plan.layouts import get_layout
from ..plan.masks import block_plan, make_mask
from .common import clock_for, progress
from .report import plan_report
from .docs import workload
from .sim import PASSES, Bar, SimConfig, _critical_path, _time_plans, reference_calls, time_reference, timed_calls

__all__ = ["simulate_masked"]


class _MaskedInputs:
    """Random local q, k, v, dout (batch 1) and persistent accumulators for one layout's row."""

    def __init__(self, cfg: SimConfig, n: int, gen: torch.Generator):
        kvh = cfg.kv_heads or cfg.heads

        def rnd(heads):
            return torch.randn((1, n, heads, cfg.head_dim), generator=gen, device=cfg.device, dtype=cfg.dtype)

        self.q, self.k, self.v, self.dout = rnd(cfg.heads), rnd(kvh), rnd(kvh), rnd(cfg.heads)
        self.out = rnd(cfg.heads)
        self.lse = torch.full((1, cfg.heads, n), 8.0, device=cfg.device)  # finite: timing only
        self.scale = cfg.head_dim ** -0.5
        self.kernel = resolve_kernel(cfg.backend, cfg.device, cfg.dtype)
        self.acc = _Accumulator(self.q, masked=True)
        self.dq = torch.zeros(self.q.shape, dtype=torch.float32, device=cfg.device)
        self.dk = torch.zeros(self.k.shape, dtype=torch.float32, device=cfg.device)
        self.dv = torch.zeros_like(self.dk)

    def forward_step(self, calls, first: bool) -> None:
        for c in calls:
            self.kernel.forward_varlen(self.q, self.k, self.v, c.segments, self.scale, self.acc.out, self.acc.lse)

    def backward_step(self, calls) -> None:
        # as the ring: the block's dK / dV in fresh buffers, then added to the travelling ones
        if not calls:
            return
        dk, dv = torch.zeros_like(self.dk), torch.zeros_like(self.dv)
        for c in calls:
            self.kernel.backward_varlen(self.dout, self.q, self.k, self.v, self.out, self.lse, c.segments,
                                        self.scale, self.dq, dk, dv)
        self.dk += dk
        self.dv += dv


def _reference(cfg: SimConfig, work, gen, clock, bar: Bar) -> dict:
    """One device, the whole row: one varlen call per pass."""
    seq = work.mask.seq_len
    mask = make_mask(seq, 1, get_layout("contiguous"), list(work.mask.bounds),
                     None if work.mask.left < 0 else (work.mask.left, 0), True)
    calls = block_plan(get_layout("contiguous"), mask, 1, 0, 0)
    inp = _MaskedInputs(cfg, seq, gen)
    fwd = time_reference(bar, lambda: inp.forward_step(calls, True), cfg, clock)
    bwd = time_reference(bar, lambda: inp.backward_step(calls), cfg, clock)
    return {"forward": fwd, "backward": bwd, "fwd+bwd": fwd + bwd}


def simulate_masked(cfg: SimConfig, tokens_per_rank: list[int], docs: str | None, window: int | None,
                    seed: int = 0) -> list[dict]:
    """JSON records ``{"layout", "world_size", "seq_len", "tokens_per_rank", "docs", "window",
    "padding_tokens", "pass", "critical_path_ms", "speedup_vs_contiguous", "speedup_vs_zigzag",
    "efficiency"}`` for every (N, tokens per rank, pass, layout)."""
    if cfg.device.type == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    clock = clock_for(cfg.device, cfg.threads)
    gen = torch.Generator(device=cfg.device).manual_seed(0)
    points = [(n, t) for n in cfg.world_sizes for t in tokens_per_rank]
    results = {}
    for n_ranks, tpr in progress(points, total=len(points), desc="sim", enabled=cfg.progress):
        ref = None
        for lay in cfg.layouts:
            work = workload(lay, n_ranks, tpr, docs, window, seed)
            layout = get_layout(lay)
            keys, plans = [], {}
            for t in range(n_ranks):
                row = []
                for r in range(n_ranks):
                    calls = block_plan(layout, work.mask, n_ranks, r, (r - t) % n_ranks)
                    # identical rank-steps are timed once, unless --every-block: the critical path takes
                    # the max over ranks, and N noisy timings of one plan have a larger max than one
                    key = (lay, t, r) if cfg.every_block else (lay, _plan_signature(calls))
                    plans[key] = (calls, False)  # the masked forward has no "first step" form
                    row.append(key)
                keys.append(row)
            inputs = _MaskedInputs(cfg, work.local_len, gen)
            with_ref = cfg.reference and ref is None and lay != "zigzag"
            bar = Bar(timed_calls(cfg, plans) + (reference_calls(cfg) if with_ref else 0),
                      f"{lay} N={n_ranks} tokens/rank={tpr}" + (" + one-device reference" if with_ref else ""),
                      cfg.progress)
            times = _time_plans(cfg, plans, inputs, clock, bar)
            del inputs
            results[(n_ranks, tpr, lay)] = (_critical_path(cfg, keys, times, work.local_len), work)
            if with_ref:
                ref = _reference(cfg, work, gen, clock, bar)
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


def _plan_signature(calls) -> tuple:
    """What a (rank, step) runs, as a hashable value: the segments of every call (shapes, starts,
    windows).  Two rank-steps with the same signature run the same kernel calls on the same local
    rows, so one timing serves both."""
    return tuple(tuple(tuple(t.tolist()) for t in (c.segments.cu_q, c.segments.cu_k, c.segments.wl, c.segments.wr,
                                                   c.segments.q_start, c.segments.k_start)) for c in calls)
