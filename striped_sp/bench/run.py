"""Real multi-process runs: spawned ranks (gloo on CPU, NCCL on CUDA), median fwd+bwd wall time.

Every rank builds random local q, k, v for its shard, then for each sequence length runs every
implementation (our layouts through :func:`striped_sp.ring_attention`, then the peers of
:mod:`.peers`) in turn, round-robin, so that load from other processes on the machine hits all of
them alike.  One iteration is: barrier, forward, backward of ``(out * dout).sum()``, device sync;
its time is the slowest rank's (all-reduce max).  Before anything is timed, whatever ``warmup``
says, each rank warms the process up (:func:`_warm_process`: one small fwd+bwd of every layout, so
that thread pools, the first collectives and the kernels' first dispatch are not charged to the first
layout timed).  The first ``warmup`` iterations are dropped; the record is the median of the next
``iters``.  Each peer's output is checked once against
``ring_attention`` with the peer's layout on the same local inputs (``max_abs_err``).

Memory (``memory=True``; ``None``, the default: on CUDA, whose allocator counts for free, and not on
the CPU, where the count runs ``torch.profiler``, whose C++ side prints two lines to stderr per
region: ``--memory`` asks for it): the first iteration of every implementation (a warm-up one unless
``warmup=0``) runs under :class:`.memory.MemoryPeak`; ``peak_mib`` is the local inputs (q, k, v,
dout) plus the peak of what fwd+bwd allocates on a rank (the gradients included), the largest over
the ranks.  ``reference=True`` adds the line ``sdpa_1proc``: one process (rank 0, the same threads
as a rank) running PyTorch's fused causal SDPA fwd+bwd on the whole sequence, timed once and
measured the same way: what context parallelism divides.

With ``profile=True`` our layouts also report, per rank, where forward and backward time goes:
kernel calls, the fp32 merge, waits on the ring transfers, and the rest (slicing, accumulation,
allocation), by timing wrappers installed in the worker processes only (:mod:`.profile`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..engine.request import ring_attention
from ..kernels import resolve_kernel
from ..plan.layouts import get_layout
from .common import init_rank, median, pick_dtype, progress, random_qkv, since, spawn_ranks, start_clocks, sync
from .docs import workload
from .memory import MemoryPeak, tensor_bytes
from .mixed import check_global_every
from .report import plan_report
from .peers import PEERS, PeerSkip
from .profile import Clock, install_profiler, profiled_step

__all__ = ["RunConfig", "run", "GLOBAL_SUFFIX"]

#: with ``global_every``, the impl name of a layout's global (unwindowed) layer: ``"zigzag|global"``
GLOBAL_SUFFIX = "|global"


@dataclasses.dataclass
class RunConfig:
    world_size: int = 2
    seq_lens: tuple = (8192,)
    layouts: tuple = ("striped", "zigzag", "contiguous")
    peers: tuple = ("torch_ring", "ulysses")
    batch: int = 1
    heads: int = 4
    kv_heads: int | None = None
    head_dim: int = 64
    dtype: str = "auto"
    device: str = "auto"  # "cpu" or "cuda"; auto: CUDA when there are enough GPUs
    backend: str = "auto"
    warmup: int = 2
    iters: int = 7
    threads: int | None = None  # CPU threads per rank; default cores // world_size
    profile: bool = False
    pin: bool = True  # CPU: pin rank r to its own core(s) when there are enough
    progress: bool = True
    force_peers: bool = False
    timeout_s: float = 900.0
    docs: str | None = None  # packed documents (see bench.docs); zigzag pads each to a multiple of 2N
    window: int = 0  # sliding window (left); 0: none
    ulysses_sizes: tuple = ()  # hierarchical CP: also run each layout with these ulysses_size values
    memory: bool | None = None  # peak memory per rank on each implementation's first iteration (None: CUDA only)
    reference: bool = True  # the sdpa_1proc line: one process, fused SDPA on the whole sequence
    global_every: tuple = ()  # with a window: also time each layout's global layer ("LAYOUT|global", .mixed)


# ---------------------------------------------------------------------------------------------
# worker
# ---------------------------------------------------------------------------------------------

def _fwd_bwd(fn, q, k, v, dout):
    for t in (q, k, v):
        t.grad = None
    out = fn(q, k, v)
    (out * dout).sum().backward()
    return out


def _warm_process(cfg: RunConfig, group, device, dtype, memory: bool) -> None:
    """One untimed fwd+bwd of every layout and peer on a small row (under the memory tracker where
    memory is measured: the profiler's first start costs seconds on the CPU), so that process
    start-up (thread pools, the first collectives, the kernels' first dispatch, a peer's first use of
    its library, the profiler) is charged to no implementation.  The shapes differ from the timed ones, so each layout's first timed
    iteration still builds its own plan, as ``warmup=0`` means."""
    n, kvh = cfg.world_size, cfg.kv_heads or cfg.heads

    def small(local):
        return random_qkv(1, local, cfg.heads, kvh, cfg.head_dim, device, dtype)

    for lay in cfg.layouts:
        local = 2 * get_layout(lay).seq_multiple  # zigzag's two chunks; a stripe size's multiple
        try:  # refused alike on every rank before any message (a placement on a row without documents)
            with MemoryPeak(device) if memory else contextlib.nullcontext():
                _fwd_bwd(lambda a, b, c, lay=lay: ring_attention(a, b, c, group, layout=lay, backend=cfg.backend),
                         *small(local))
        except ValueError:
            pass  # its first timed iteration warms it
    for peer in () if cfg.docs or cfg.window else cfg.peers:
        q, k, v, dout = small(2 * n)
        try:  # a peer that cannot run is reported by the timed phase, not here
            fn, _ = PEERS[peer](group, {"force_peers": cfg.force_peers}, q, k, v)
            _fwd_bwd(fn, q, k, v, dout)
        except Exception:  # noqa: BLE001
            pass
    sync(device)
    dist.barrier()


def _worker_body(rank, cfg: RunConfig, device_type, init_file, results):
    n_ranks = cfg.world_size
    device = init_rank(rank, n_ranks, device_type, init_file, cfg.timeout_s, cfg.threads, cfg.pin)
    group = dist.group.WORLD
    dtype = pick_dtype(cfg.dtype, device)
    kvh = cfg.kv_heads or cfg.heads
    gen = torch.Generator().manual_seed(1234 + rank)
    clock = Clock(device)
    if cfg.profile:
        install_profiler(clock)
    kernel = resolve_kernel(cfg.backend, device, dtype)
    memory = cfg.memory if cfg.memory is not None else device.type == "cuda"
    _warm_process(cfg, group, device, dtype, memory)
    records, notes, profile = [], {}, []
    tasks = [(s, i) for s in cfg.seq_lens for i in range(cfg.warmup + cfg.iters)]
    bar = progress(tasks, total=len(tasks), desc=f"run N={n_ranks}", enabled=cfg.progress and rank == 0)
    current = None
    for seq, it in bar:
        if seq != current:
            current = seq
            n = seq // n_ranks
            for lay in cfg.layouts:
                get_layout(lay).check_seq_len(seq, n_ranks)

            q, k, v, dout = random_qkv(cfg.batch, n, cfg.heads, kvh, cfg.head_dim, device, dtype, gen)
            impls, inputs, padding = {}, {}, {}
            for lay in cfg.layouts:
                mask_kw, inputs[lay] = {}, (q, k, v, dout)
                if cfg.docs or cfg.window:
                    work = workload(lay, n_ranks, n, cfg.docs, cfg.window)
                    mask_kw = {"cu_seqlens": torch.tensor(work.mask.bounds) if cfg.docs else None,
                               "window_size": (cfg.window, 0) if cfg.window else None,
                               "sharded_by_documents": True}  # random local rows: nothing was sharded
                    padding[lay] = work.padding_tokens
                    if work.local_len != n:  # zigzag's padded row
                        m = work.local_len
                        inputs[lay] = random_qkv(cfg.batch, m, cfg.heads, kvh, cfg.head_dim, device, dtype, gen)
                        notes[(seq, lay)] = f"{work.padding_tokens} padding tokens"
                impls[lay] = (lambda a, b, c, lay=lay, kw=mask_kw: ring_attention(
                    a, b, c, group, layout=lay, backend=cfg.backend, **kw), lay)
                if cfg.global_every:  # the global layer of a mixed model: the same row, no window
                    name, kw = f"{lay}{GLOBAL_SUFFIX}", {**mask_kw, "window_size": None}
                    inputs[name], padding[name] = inputs[lay], padding.get(lay, 0)
                    impls[name] = (lambda a, b, c, lay=lay, kw=kw: ring_attention(
                        a, b, c, group, layout=lay, backend=cfg.backend, **kw), lay)
                for u in cfg.ulysses_sizes:  # Ulysses over groups of u ranks, the ring across them
                    inputs[f"{lay}+u{u}"] = inputs[lay]
                    impls[f"{lay}+u{u}"] = (lambda a, b, c, lay=lay, kw=mask_kw, u=u: ring_attention(
                        a, b, c, group, layout=lay, backend=cfg.backend, ulysses_size=u, **kw), lay)
            for peer in cfg.peers:
                if cfg.docs or cfg.window:
                    notes[(seq, peer)] = "skipped: the peers take no packed documents or windows"
                    continue
                try:
                    impls[peer] = PEERS[peer](group, {"force_peers": cfg.force_peers}, q, k, v)
                except PeerSkip as e:
                    notes[(seq, peer)] = f"skipped: {e}"
            samples, peaks, cpu_samples = {name: [] for name in impls}, {}, {}
            prof = {name: {} for name in cfg.layouts}
        for name in list(impls):
            fn, lay = impls[name]
            failed = torch.zeros(1, device=device)
            args = inputs.get(name, (q, k, v, dout))
            for t in args[:3]:
                t.grad = None  # freed outside the memory window
            out = None
            tracker = MemoryPeak(device) if memory and it == 0 else contextlib.nullcontext()
            dist.barrier()
            clock.t, clock.phase = {}, "fwd"
            start = start_clocks()
            try:
                with tracker:
                    if cfg.profile and name in cfg.layouts and not (cfg.docs or cfg.window):
                        out = profiled_step(*args, group, lay, kernel, clock)
                    else:
                        out = _fwd_bwd(fn, *args)
                    sync(device)
            except Exception as e:  # noqa: BLE001 - a peer failing here is a skip, not a crash
                if name in cfg.layouts or "+u" in name:
                    raise
                failed += 1
                notes[(seq, name)] = f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            dt = since(start, device)  # wall and CPU time: under load the busiest rank's CPU time ranks plans
            dist.all_reduce(failed)
            if failed.item():
                notes.setdefault((seq, name), "skipped: failed on another rank")
                del impls[name]
                continue
            if it == 0 and memory:
                peaks[name] = _max_over_ranks(tensor_bytes(*args) + tracker.peak, device)
            if it == 0 and name in cfg.peers:
                ref = ring_attention(q.detach(), k.detach(), v.detach(), group, layout=lay, backend=cfg.backend)
                err = (out.detach().float() - ref.float()).abs().max().reshape(1)
                dist.all_reduce(err, op=dist.ReduceOp.MAX)
                notes[(seq, name)] = f"{lay} layout, max_abs_err vs ring_attention {err.item():.1e}"
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            if it >= cfg.warmup:
                samples[name].append(dt[0].item())
                cpu_samples.setdefault(name, []).append(dt[1].item())
                for key, val in clock.t.items():
                    prof.setdefault(name, {}).setdefault(key, []).append(val)
        if it == cfg.warmup + cfg.iters - 1:
            base = median(samples["contiguous"]) if samples.get("contiguous") else None
            for name, ts in samples.items():
                if not ts:
                    continue
                m = median(ts)
                records.append({"impl": name, "world_size": n_ranks, "seq_len": seq, "median_ms": m * 1e3,
                                "speedup_vs_contiguous": base / m if base else None,
                                "docs": cfg.docs, "window": cfg.window, "padding_tokens": padding.get(name, 0),
                                "peak_mib": _mib(peaks.get(name)), "samples_ms": [t * 1e3 for t in ts],
                                "cpu_samples_ms": [t * 1e3 for t in cpu_samples.get(name, [])]})
            for name in cfg.peers:
                if name not in samples or not samples[name]:
                    records.append({"impl": name, "world_size": n_ranks, "seq_len": seq, "median_ms": None,
                                    "speedup_vs_contiguous": None, "docs": cfg.docs, "window": cfg.window,
                                    "padding_tokens": 0, "peak_mib": None, "samples_ms": [], "cpu_samples_ms": []})
            if cfg.reference:
                ms, peak = _reference(cfg, seq, dtype, device, kvh, rank == 0, memory)
                records.append({"impl": "sdpa_1proc", "world_size": 1, "seq_len": seq, "median_ms": ms,
                                "speedup_vs_contiguous": base / (ms / 1e3) if base and ms else None,
                                "docs": cfg.docs, "window": cfg.window, "padding_tokens": 0,
                                "peak_mib": _mib(peak), "samples_ms": [ms] if ms else [], "cpu_samples_ms": []})
                notes[(seq, "sdpa_1proc")] = ("one process, the whole sequence, 1 run" + (
                    "; causal only: no documents or window" if cfg.docs or cfg.window else ""))
            for name, d in prof.items():
                if d:
                    profile.append({"impl": name, "seq_len": seq, "rank": rank,
                                    **{k2: median(v2) * 1e3 for k2, v2 in d.items()},
                                    "total": median(samples[name]) * 1e3})
    results.put(("ok", rank, (records, {f"{s}|{p}": m for (s, p), m in notes.items()}, profile)))
    dist.barrier()
    dist.destroy_process_group()


def _mib(nbytes):
    return None if nbytes is None else nbytes / 2**20


def _max_over_ranks(nbytes: int, device) -> int:
    t = torch.tensor([float(nbytes)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def _reference(cfg: RunConfig, seq: int, dtype, device, kv_heads: int, mine: bool, memory: bool):
    """``(ms, peak bytes)`` of one fwd+bwd of PyTorch's fused causal SDPA over all ``seq`` tokens in
    one process (rank 0; the others wait), inputs included; ``(None, None)`` when it fails."""
    ms = peak = None
    if mine:
        try:
            gen = torch.Generator().manual_seed(99)
            q, k, v, dout = random_qkv(cfg.batch, seq, cfg.heads, kv_heads, cfg.head_dim, device, dtype, gen)

            def sdpa(q, k, v):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=True, enable_gqa=k.size(2) != q.size(2)).transpose(1, 2)

            with MemoryPeak(device) if memory else contextlib.nullcontext() as mem:
                t0 = time.perf_counter()
                _fwd_bwd(sdpa, q, k, v, dout)
                sync(device)
                ms = (time.perf_counter() - t0) * 1e3
            peak = tensor_bytes(q, k, v, dout) + mem.peak if memory else None
        except Exception:  # noqa: BLE001 - out of memory on one device, say: the line stays empty
            ms = peak = None
    dist.barrier()
    return ms, peak


def run(cfg: RunConfig):
    """Spawn the ranks; returns (records, notes, profile rows).

    ``records``: ``{"impl", "world_size", "seq_len", "median_ms", "speedup_vs_contiguous", "docs", "window",
    "padding_tokens", "peak_mib", "samples_ms", "cpu_samples_ms"}`` (``peak_mib``: the largest rank's peak,
    module docstring; ``samples_ms`` / ``cpu_samples_ms``: every round's wall time of the slowest rank and
    CPU time of the busiest, empty where nothing ran), and for a
    striped layout with parameters ``plan``, ``plan_balance``, ``predicted_forward_ms``
    (:func:`.report.plan_report`); with ``global_every`` also the records of ``LAYOUT|global``
    (the same row without the window) for :func:`.mixed.combine_layers`;
    ``notes``: ``{(seq_len, impl): text}``; ``profile``: per (impl, seq_len, rank) milliseconds.
    """
    if cfg.device == "auto":
        device_type = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= cfg.world_size else "cpu"
    else:
        device_type = torch.device(cfg.device).type
    if device_type == "cuda" and torch.cuda.device_count() < cfg.world_size:
        raise ValueError(f"world_size={cfg.world_size} needs that many GPUs, found {torch.cuda.device_count()}")
    if "contiguous" not in cfg.layouts:
        raise ValueError("run needs the 'contiguous' layout: speedups are relative to it")
    if cfg.docs and cfg.batch != 1:
        raise ValueError(f"--docs packs one row: batch must be 1, got {cfg.batch}")
    for peer in cfg.peers:
        if peer not in PEERS:
            raise ValueError(f"unknown peer {peer!r}: expected some of {sorted(PEERS)}")
    for seq in cfg.seq_lens:
        for lay in cfg.layouts:
            get_layout(lay).check_seq_len(seq, cfg.world_size)
    if cfg.global_every:
        check_global_every(list(cfg.global_every), cfg.window)
        if cfg.ulysses_sizes or cfg.profile:
            raise ValueError("global_every (--global-every) combines with neither ulysses_sizes nor profile")
    got = spawn_ranks(_worker_body, (cfg, device_type), cfg.world_size, cfg.timeout_s, "bench run")
    records, notes, _ = got[0]
    for r in records:  # the placement each striped layout with parameters chose, and its prediction
        if r["impl"].split(GLOBAL_SUFFIX)[0] in cfg.layouts:
            tpr = r["seq_len"] // cfg.world_size
            bounds = workload("striped", cfg.world_size, tpr, cfg.docs, None).mask.bounds
            windowed = bool(cfg.window) and not r["impl"].endswith(GLOBAL_SUFFIX)
            r.update(plan_report(r["impl"].split(GLOBAL_SUFFIX)[0], bounds, cfg.world_size, windowed, cfg.heads))
    profile = [row for r in sorted(got) for row in got[r][2]]
    return records, {tuple((int(k.split("|")[0]), k.split("|")[1])): v for k, v in notes.items()}, profile
