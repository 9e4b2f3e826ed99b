"""N ranks simulated on one device, with the real kernels.

For every layout, ring size ``N`` and sequence length ``S`` (``n = S / N`` tokens per rank), each
rank's work at each ring step is what :class:`striped_sp.engine.autograd._RingAttention` does there:

* forward: the layout's kernel calls for (rank, source), each followed by the fp32 merge of its
  (out, lse) into the running accumulators (step 0 starts them from the diagonal block);
* backward: the kernel backward of the same calls with the final out/lse, then the fp32 dQ and
  dK/dV accumulation.

Kernel time depends on the call shapes only, so a rank-step is timed once per distinct plan and
reused for every (rank, step) with that plan (``every_block=True`` times each one separately).
A step lasts as long as its slowest rank, or as the transfer of the block to the next rank when a
link bandwidth is given and the transfer is longer (it overlaps the compute).  The critical path
is the sum of the step times.  The baseline for efficiency is one device running full causal
attention over all ``S`` tokens, divided by ``N``.
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels import Kernel, resolve_kernel
from ..plan.layouts import get_layout
from ..engine.step import Accumulator, backward_step, forward_step, seq_slice, strict_block_mode, to_format
from .common import clock_for, median, progress, sync, time_call, time_once
from .work import step_entries

__all__ = ["SimConfig", "simulate"]

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
    every_block: bool = False
    reference: bool = True  # time the single-device full causal baseline (efficiency)
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


class _Inputs:
    """Random q, k, v, dout, out, lse for ``n`` local tokens in the kernel's tensor format, and
    fresh accumulators; each step runs :func:`striped_sp.engine.step.forward_step` /
    :func:`~striped_sp.engine.step.backward_step`, as the ring does."""

    def __init__(self, cfg: SimConfig, n: int, gen: torch.Generator):
        kvh = cfg.kv_heads or cfg.heads
        b, h, d = cfg.batch, cfg.heads, cfg.head_dim
        self.kernel = resolve_kernel(cfg.backend, cfg.device, cfg.dtype)
        if cfg.tensor_format == "bshd" and self.kernel.tensor_format != "bshd":
            self.kernel = _AsBshd(self.kernel)
        self.fmt = self.kernel.tensor_format
        self.aligned = strict_block_mode(self.kernel, cfg.device, cfg.dtype, d, cfg.strict_block) == "aligned"

        def rnd(heads):  # drawn on the device: the reference at 256k tokens is GBs per tensor
            return to_format(torch.randn((b, n, heads, d), generator=gen, device=cfg.device, dtype=cfg.dtype),
                             self.fmt)

        self.q, self.k, self.v, self.dout = rnd(h), rnd(kvh), rnd(kvh), rnd(h)
        self.scale = d ** -0.5
        out, lse = self.kernel.forward_native(self.q, self.k, self.v, True, self.scale)
        self.out, self.lse = out, lse
        self.acc = Accumulator(self.q, fmt=self.fmt)
        self.acc.add(slice(None), out, lse)
        self.dq = torch.zeros(self.q.shape, dtype=torch.float32, device=cfg.device)
        self.dk = torch.zeros(self.k.shape, dtype=torch.float32, device=cfg.device)
        self.dv = torch.zeros(self.v.shape, dtype=torch.float32, device=cfg.device)

    def forward_step(self, calls, first: bool) -> None:
        acc = Accumulator(self.q, fmt=self.fmt) if first else self.acc  # step 0 starts from its block
        forward_step(self.kernel, self.q, self.k, self.v, calls, self.scale, acc, self.aligned)

    def backward_step(self, calls) -> None:
        grads = backward_step(self.kernel, self.dout, self.q, self.k, self.v, self.out, self.lse, calls,
                              self.scale, self.dq, self.fmt, self.aligned)
        for rows, dk, dv in grads:
            seq_slice(self.dk, rows, self.fmt).add_(dk)
            seq_slice(self.dv, rows, self.fmt).add_(dv)


class Bar:
    """A manual progress bar on stderr (tqdm, the bench extra) for the timed calls of one point;
    does nothing when off or without tqdm.  Ticks happen between timed calls (never inside one),
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


def timed_calls(cfg: SimConfig, plans: dict) -> int:
    """How many (forward, backward) pairs :func:`_time_plans` runs: the bar's share of them."""
    return (cfg.reps + 1) * sum(1 for calls, _ in plans.values() if calls)


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


def _plan_key(calls, n):
    return tuple((c.q.indices(n), c.kv.indices(n), c.causal, c.strict) for c in calls)


def _transfer_s(cfg: SimConfig, n: int, backward: bool, last_step: bool) -> float:
    """Seconds to send one rank's KV block (and in backward its fp32 dK/dV) over one link."""
    if not cfg.link_gbps:
        return 0.0
    kvh = cfg.kv_heads or cfg.heads
    elems = 2 * cfg.batch * n * kvh * cfg.head_dim
    nbytes = 0 if last_step else elems * torch.tensor([], dtype=cfg.dtype).element_size()
    if backward:
        nbytes += elems * 4  # the fp32 dK/dV accumulators travel every step (N hops)
    return nbytes / (cfg.link_gbps * 1e9)


def _rank_step_keys(cfg: SimConfig, layout: str, world_size: int, n: int):
    """``keys[t][r]``: the timing key of rank ``r`` at step ``t``, and ``plans``: key -> (calls, first)."""
    lay = get_layout(layout)
    keys, plans = [], {}
    for t in range(world_size):
        row = []
        for r in range(world_size):
            calls = lay.plan(r, (r - t) % world_size, world_size, n, True)
            key = (t == 0, _plan_key(calls, n))
            if cfg.every_block:
                key = (layout, r, t) + key
            plans[key] = (calls, t == 0)
            row.append(key)
        keys.append(row)
    return keys, plans


def _time_plans(cfg: SimConfig, plans: dict, inputs: "_Inputs", clock, bar: Bar | None = None) -> dict:
    """Median (forward, backward) seconds per plan, timed round-robin over all plans (so that a
    change of machine load hits every plan alike), after one warm-up round.  ``bar`` ticks once per
    plan and round, between the timed calls."""
    dev = cfg.device
    samples = {key: ([], []) for key in plans}
    for rnd in range(cfg.reps + 1):
        for key, (calls, first) in plans.items():
            if not calls:
                continue
            fwd = time_once(lambda: inputs.forward_step(calls, first), dev, clock)
            bwd = time_once(lambda: inputs.backward_step(calls), dev, clock)
            if bar is not None:
                bar.tick()
            if rnd > 0:
                samples[key][0].append(fwd)
                samples[key][1].append(bwd)
    return {key: (median(f), median(b)) if f else (0.0, 0.0) for key, (f, b) in samples.items()}


def _critical_path(cfg: SimConfig, keys, times: dict, n: int) -> dict:
    """Critical-path seconds per pass: sum over steps of max(slowest rank, transfer)."""
    crit = {"forward": 0.0, "backward": 0.0}
    world_size = len(keys)
    for t, row in enumerate(keys):
        last = t == world_size - 1
        for i, p in enumerate(("forward", "backward")):
            worst = max(times[key][i] for key in row)
            crit[p] += max(worst, _transfer_s(cfg, n, p == "backward", last))
    crit["fwd+bwd"] = crit["forward"] + crit["backward"]
    return crit


def _reference(cfg: SimConfig, seq_len: int, gen: torch.Generator, clock, bar: Bar | None = None) -> dict:
    """Single-device full causal attention over ``seq_len`` tokens: seconds per pass."""
    inp = _Inputs(cfg, seq_len, gen)
    from ..plan.layouts import BlockCall

    bar = bar or Bar(0, "", False)
    full = [BlockCall(slice(None), slice(None), True)]
    fwd = time_reference(bar, lambda: inp.kernel.forward_native(inp.q, inp.k, inp.v, True, inp.scale), cfg, clock)
    bwd = time_reference(bar, lambda: inp.backward_step(full), cfg, clock)
    del inp
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
    if cfg.device.type == "cpu" and cfg.threads:
        torch.set_num_threads(cfg.threads)
    clock = clock_for(cfg.device, cfg.threads)
    gen = torch.Generator(device=cfg.device).manual_seed(0)
    crits: dict = {}
    refs: dict = {}
    for n_ranks, seq in progress(points, total=len(points), desc="sim", enabled=cfg.progress):
        n = seq // n_ranks
        inputs = _Inputs(cfg, n, gen)
        per_layout, plans = {}, {}
        for lay in cfg.layouts:
            per_layout[lay], p = _rank_step_keys(cfg, lay, n_ranks, n)
            plans.update(p)  # identical plans (e.g. every layout's diagonal block) are timed once
        ref = cfg.reference and seq not in refs
        bar = Bar(timed_calls(cfg, plans) + (reference_calls(cfg) if ref else 0),
                  f"N={n_ranks} S={seq} blocks" + (" + one-device reference" if ref else ""), cfg.progress)
        times = _time_plans(cfg, plans, inputs, clock, bar)
        for lay in cfg.layouts:
            crits[(n_ranks, seq, lay)] = _critical_path(cfg, per_layout[lay], times, n)
        del inputs  # free the block inputs before the big single-device run
        if ref:
            refs[seq] = _reference(cfg, seq, gen, clock, bar)
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
