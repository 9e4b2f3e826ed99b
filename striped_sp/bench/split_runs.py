"""What ``bench hybrid-split``'s two units (one mixer layer: :mod:`.hybrid_split`; a whole tiny hybrid:
:mod:`.hybrid_model`) share: the spawned ranks of every N, and one mode's timed steps."""

from __future__ import annotations

import time

import torch

from .common import median, spawn_ranks

__all__ = ["spawn_all", "timed_steps"]


def spawn_all(cfg, kinds, worker, what: str) -> list[dict]:
    """``cfg``'s kinds (each one of ``kinds``) and shapes checked, then ``worker``'s records on ``N``
    spawned ranks, for each ``N`` of ``cfg.world_sizes``."""
    for kind in cfg.kinds:
        if kind not in kinds:
            raise ValueError(f"mixer kind {kind!r}: expected one of {', '.join(kinds)}")
    for n in cfg.world_sizes:
        for s in cfg.seq_lens:
            if s % n:
                raise ValueError(f"seq_len {s} does not divide by N={n}")
    records = []
    for n in cfg.world_sizes:
        records += spawn_ranks(worker, (cfg, n, "cpu"), n, cfg.timeout_s, f"{what} N={n}")[0]
    return records


def timed_steps(step, reps: int, active: bool, memory: bool, prepare=None, count=None) -> tuple[dict, int]:
    """``step(*prepare())`` ``reps + 1`` times (the first a warm-up) on the ranks where ``active``, each
    between barriers of every rank, then once more under :class:`~striped_sp.bench.memory.MemoryPeak`
    where ``memory``; ``prepare`` (untimed) makes its arguments.  Returns the figures of the busiest rank
    (``cpu_ms``: the median of its process CPU time; ``ms``: of its wall time; ``peak_mib``: the largest
    peak of tensor memory above the step's start; 0 where not measured) and what ``count()`` grew by in
    this rank's last timed step (bytes sent)."""
    import torch.distributed as dist

    from .memory import MemoryPeak

    prepare = prepare or tuple
    count = count or (lambda: 0)
    cpu, wall, sent = [], [], 0
    for i in range(reps + 1):
        dist.barrier()
        if not active:
            continue
        args = prepare()
        c0, t0, b0 = time.process_time(), time.perf_counter(), count()
        step(*args)
        if i:
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - t0)
            sent = count() - b0
    peak = 0
    dist.barrier()
    if active and memory:
        args = prepare()
        with MemoryPeak("cpu") as mem:
            step(*args)
        peak = mem.peak
    stats = torch.tensor([median(cpu) if cpu else 0.0, median(wall) if wall else 0.0, float(peak)],
                         dtype=torch.float64)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    return {"cpu_ms": stats[0].item() * 1e3, "ms": stats[1].item() * 1e3, "peak_mib": stats[2].item() / 2**20}, sent
