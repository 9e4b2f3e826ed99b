"""N ranks simulated on one device: the engine's own executor on a :class:`LocalRing`, timed.

For every layout and point ``(N, S)`` each rank's :class:`~striped_sp.plan.ring_plan.RingPlan` is
built once (:func:`striped_sp.engine.local.local_plans`, as :class:`~striped_sp.engine.request.RingRequest`
builds it; planning is never timed) and the ranks' :func:`~striped_sp.engine.autograd.forward_steps` /
:func:`~striped_sp.engine.autograd.backward_steps` generators run side by side on a
:class:`~striped_sp.engine.transport.LocalRing` without copies (:func:`~striped_sp.engine.transport.run_local`).
Its clock gives each rank's part of each round (a round: everything a rank runs between two of its
transfers; the device synchronised after it); per (rank, round) the median over ``reps`` runs after
one warm-up run.  Every (rank, round) is run and timed: nothing is shared between ranks or steps.

A round lasts as long as its slowest rank, or as the transfer posted in it when a link bandwidth
is given and the transfer is longer (it overlaps the compute): the bytes a rank posts (the
LocalRing's ``sent_bytes``: shared rows only, dK/dV in the plan's comm dtype) over one link.  The
critical path is the sum over rounds, forward and backward separately.  The baseline for
efficiency is the same executor on one device over all ``S`` tokens (contiguous, ``N = 1``),
divided by ``N``.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from ..engine import autograd
from ..engine.local import local_plans
from ..engine.request import RingRequest
from ..engine.step import strict_block_mode
from ..engine.transport import LocalRing, run_local
from ..kernels import Kernel, resolve_kernel
from ..plan.layouts import get_layout
from .common import clock_for, median, progress, sync, time_call
from .work import step_entries

__all__ = ["SimConfig", "simulate", "ring_plans", "time_rings", "reference_seconds", "Bar", "PASSES"]

PASSES = ("forward", "backward", "fwd+bwd")


@dataclasses.dataclass
class SimConfig:
    layouts: tuple = ("striped", "zigzag", "contiguous")
    world_sizes: tuple = (8,)
    seq_lens: tuple = (32768,)
    points: tuple | None = None  # explicit (world_size, seq_len) pairs; default: the product
    batch: int = 1
    heads: int = 4
    kv_heads: int | None = None
    head_dim: int = 64
    dtype: torch.dtype = torch.float32
    device: torch.device = torch.device("cpu")
    backend: str = "auto"
    reps: int = 3
    link_gbps: float | None = None  # GB/s per ring link; None: compute only
    reference: bool = True  # time the single-device baseline (efficiency)
    progress: bool = True
    threads: int | None = 1  # CPU threads (one simulated rank = one core); None: torch's default
    strict_block: str | None = None  # "sliced" / "aligned" (striped strict block); None: the kernel's
    tensor_format: str = "native"  # "native": the kernel's own format; "bshd": through its [b, s, h, d] API


class _AsBshd(Kernel):
    """``inner`` seen through its ``[b, s, h, d]`` API (strided views into its ops), to time the
    ring in the public format against the kernel's own one."""

    tensor_format = "bshd"

    def __init__(self, inner: Kernel):
        self.inner, self.name, self.default_strict_block = inner, inner.name, inner.default_strict_block

    def causal_alignment(self, *a):
        return self.inner.causal_alignment(*a)

    def forward_native(self, *a):
        return self.inner.forward(*a)

    def backward_native(self, *a):
        return self.inner.backward(*a)


class Bar:
    """A manual progress bar on stderr (tqdm, the bench extra) for the timed runs of one point;
    does nothing when off or without tqdm.  Ticks happen between timed runs (never inside one),
    except in :func:`time_reference`, whose tick costs microseconds against the reference's long calls."""

    def __init__(self, total: int, desc: str, enabled: bool):
        self.bar = progress(None, total=total, desc=desc, enabled=enabled) if enabled and total else None

    def tick(self, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(n)

    def add_to_total(self, n: int) -> None:
        if self.bar is not None and n:
            self.bar.total += n
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def ring_calls(cfg: SimConfig, rings: int) -> int:
    """The bar's ticks for ``rings`` rings: one per ring and run (a warm-up and ``reps``)."""
    return (cfg.reps + 1) * rings


def reference_calls(cfg: SimConfig) -> int:
    """The calls of the reference's two passes when they are short (``time_call``: a warm-up and
    ``reps``); :func:`time_reference` corrects the bar when they are long."""
    return 2 * (cfg.reps + 1) if cfg.reference else 0


_LONG_S = 1.0  # time_call's long_s: a longer warm-up takes max(2, reps // 2) samples instead of reps


def time_reference(bar: Bar, fn, cfg: SimConfig, clock) -> float:
    """``time_call(fn)`` (median seconds) with a bar tick after each call; when the warm-up is
    long, ``time_call`` takes fewer samples and the bar's total is corrected to match."""
    state = {"calls": 0}

    def run():
        t0 = clock()
        out = fn()
        sync(cfg.device)
        if state["calls"] == 0 and clock() - t0 > _LONG_S:
            bar.add_to_total(max(2, cfg.reps // 2) - cfg.reps)
        state["calls"] += 1
        bar.tick()
        return out

    return time_call(run, cfg.device, cfg.reps, long_s=_LONG_S, clock=clock)


def sim_kernel(cfg: SimConfig) -> Kernel:
    """The kernel of the sweep (seen through its ``[b, s, h, d]`` API with ``tensor_format="bshd"``)."""
    kernel = resolve_kernel(cfg.backend, cfg.device, cfg.dtype, cfg.head_dim)
    return _AsBshd(kernel) if cfg.tensor_format == "bshd" and kernel.tensor_format != "bshd" else kernel


def sim_setup(cfg: SimConfig) -> tuple[torch.Generator, Kernel]:
    """What every sweep of ``bench sim`` starts from (dense or masked): ``cfg.threads`` compute threads on
    a CPU, the inputs' generator (seed 0, on the device) and the kernel (:func:`sim_kernel`)."""
    if cfg.device.type == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    return torch.Generator(device=cfg.device).manual_seed(0), sim_kernel(cfg)


def ring_plans(cfg: SimConfig, request: RingRequest, world_size: int, local_len: int, kernel: Kernel) -> list:
    """Every rank's plan for ``request`` (built once, reused by every run), with the strict block
    form of ``cfg`` (``ValueError`` for ``"aligned"`` on a kernel that cannot run it)."""
    plans = local_plans(request, world_size, local_len, device=cfg.device, dtype=cfg.dtype, head_dim=cfg.head_dim,
                        scale=cfg.head_dim ** -0.5, batch=cfg.batch, kernel=kernel, heads=cfg.heads)
    dense_striped = request.layout.strict_block and not plans[0].masked and request.causal
    if strict_block_mode(kernel, cfg.device, cfg.dtype, cfg.head_dim, cfg.strict_block,
                         applies=dense_striped) == "aligned":
        plans = [dataclasses.replace(p, aligned=True) for p in plans]
    return plans


@dataclasses.dataclass
class _Ring:
    """One layout's plans, its inputs (shared by the ranks: only shapes matter) and the samples."""

    plans: list
    inputs: tuple
    seconds: dict = dataclasses.field(default_factory=lambda: {"forward": {}, "backward": {}})
    sent: dict = dataclasses.field(default_factory=lambda: {"forward": {}, "backward": {}})


def _synced(steps, ring: LocalRing, device, sent: dict, rank: int):
    """``steps`` as run_local runs it, the device synchronised after each part (so the part's
    time on run_local's clock includes its kernels) and the bytes it posts counted per round."""
    rnd = 0
    while True:
        before = ring.sent_bytes
        try:
            transfer = next(steps)
        except StopIteration as done:
            sync(device)
            return done.value
        sync(device)
        sent[(rank, rnd)] = ring.sent_bytes - before
        yield transfer
        rnd += 1


def _run(cfg: SimConfig, ring: _Ring, keep: bool) -> None:
    """One forward and one backward of every rank on the executor; ``keep``: record the samples."""
    n = len(ring.plans)
    q, k, v, dout = ring.inputs
    local = LocalRing(n, copy=False)
    results = {}
    for p in ("forward", "backward"):
        seconds, sent = {}, {}

        def clock(rank, rnd, s, seconds=seconds):
            seconds[(rank, rnd)] = s

        if p == "forward":
            gens = [autograd.forward_steps(q, k, v, ring.plans[r], local.transports[r]) for r in range(n)]
        else:
            gens = [autograd.backward_steps(dout, q, k, v, *results["forward"][r], ring.plans[r], local.transports[r])
                    for r in range(n)]
        sync(cfg.device)
        results[p] = run_local([_synced(g, local, cfg.device, sent, r) for r, g in enumerate(gens)], clock,
                               timer=clock_for(cfg.device, cfg.threads))
        if keep:
            for key, s in seconds.items():
                ring.seconds[p].setdefault(key, []).append(s)
            ring.sent[p] = sent


def _critical_path(cfg: SimConfig, ring: _Ring) -> dict:
    """Seconds per pass: the sum over rounds of max(slowest rank, longest transfer posted)."""
    crit = {}
    for p in ("forward", "backward"):
        rounds: dict = {}
        for (rank, rnd), samples in ring.seconds[p].items():
            rounds[rnd] = max(rounds.get(rnd, 0.0), median(samples))
        if cfg.link_gbps:
            for (rank, rnd), nbytes in ring.sent[p].items():
                rounds[rnd] = max(rounds.get(rnd, 0.0), nbytes / (cfg.link_gbps * 1e9))
        crit[p] = sum(rounds.values())
    crit["fwd+bwd"] = crit["forward"] + crit["backward"]
    return crit


def random_inputs(cfg: SimConfig, local_len: int, gen: torch.Generator, batch: int | None = None) -> tuple:
    """Random q, k, v, dout ``[b, local_len, h, d]``, drawn on the device."""
    kvh = cfg.kv_heads or cfg.heads
    shape = (cfg.batch if batch is None else batch, local_len)
    return tuple(torch.randn((*shape, h, cfg.head_dim), generator=gen, device=cfg.device, dtype=cfg.dtype)
                 for h in (cfg.heads, kvh, kvh, cfg.heads))


def time_rings(cfg: SimConfig, rings: dict, bar: Bar) -> dict:
    """``{name: {pass: critical-path seconds}}`` for ``rings`` (name -> (plans, inputs)), run
    round-robin (so that a change of machine load hits every ring alike), one warm-up run first."""
    state = {name: _Ring(plans, inputs) for name, (plans, inputs) in rings.items()}
    for rep in range(cfg.reps + 1):
        for ring in state.values():
            _run(cfg, ring, keep=rep > 0)
            bar.tick()
    return {name: _critical_path(cfg, ring) for name, ring in state.items()}


def reference_seconds(cfg: SimConfig, request: RingRequest, seq_len: int, kernel: Kernel, gen, bar: Bar) -> dict:
    """One device, the whole row: the executor's plan of a ring of one, each pass timed alone."""
    (plan,) = ring_plans(cfg, request, 1, seq_len, kernel)
    q, k, v, dout = random_inputs(cfg, seq_len, gen)
    one = LocalRing(1, copy=False).transports[0]
    out, lse = run_local([autograd.forward_steps(q, k, v, plan, one)])[0]
    clock = clock_for(cfg.device, cfg.threads)
    fwd = time_reference(bar, lambda: run_local([autograd.forward_steps(q, k, v, plan, one)]), cfg, clock)
    bwd = time_reference(bar, lambda: run_local([autograd.backward_steps(dout, q, k, v, out, lse, plan, one)]),
                         cfg, clock)
    return {"forward": fwd, "backward": bwd, "fwd+bwd": fwd + bwd}


def work_speedup(layout: str, world_size: int, n: int) -> float:
    """The work model's speedup of ``layout`` over contiguous (critical-path entries ratio)."""
    def crit(lay):
        return sum(max(row) for row in step_entries(lay, world_size, n))
    return crit("contiguous") / crit(layout)


def simulate(cfg: SimConfig) -> list[dict]:
    """JSON records ``{"layout", "world_size", "seq_len", "pass", "critical_path_ms",
    "speedup_vs_contiguous", "efficiency"}`` for every (N, S, pass, layout) of the sweep."""
    points = list(cfg.points or [(n, s) for n in cfg.world_sizes for s in cfg.seq_lens])
    for n_ranks, seq in points:
        for layout in cfg.layouts:
            get_layout(layout).check_seq_len(seq, n_ranks)
    gen, kernel = sim_setup(cfg)
    crits: dict = {}
    refs: dict = {}
    for n_ranks, seq in progress(points, total=len(points), desc="sim", enabled=cfg.progress):
        n = seq // n_ranks
        inputs = random_inputs(cfg, n, gen)
        rings = {lay: (ring_plans(cfg, RingRequest(None, layout=lay), n_ranks, n, kernel), inputs)
                 for lay in cfg.layouts}
        ref = cfg.reference and seq not in refs
        bar = Bar(ring_calls(cfg, len(rings)) + (reference_calls(cfg) if ref else 0),
                  f"N={n_ranks} S={seq} blocks" + (" + one-device reference" if ref else ""), cfg.progress)
        for lay, crit in time_rings(cfg, rings, bar).items():
            crits[(n_ranks, seq, lay)] = crit
        del inputs, rings  # free the ranks' inputs before the big single-device run
        if ref:
            refs[seq] = reference_seconds(cfg, RingRequest(None, layout="contiguous"), seq, kernel, gen, bar)
        bar.close()
    records = []
    for n_ranks, seq in points:
        for p in PASSES:
            base = crits.get((n_ranks, seq, "contiguous"))
            for lay in cfg.layouts:
                c = crits[(n_ranks, seq, lay)][p]
                records.append({
                    "layout": lay,
                    "world_size": n_ranks,
                    "seq_len": seq,
                    "pass": p,
                    "critical_path_ms": c * 1e3,
                    "speedup_vs_contiguous": (base[p] / c) if base else None,
                    "efficiency": (refs[seq][p] / n_ranks / c) if seq in refs else None,
                })
    return records
