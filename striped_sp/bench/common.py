"""Helpers shared by the benchmark modes: devices, dtypes, timing, progress bars."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Iterable

import torch

__all__ = ["DTYPES", "pick_device", "pick_dtype", "sync", "clock_for", "time_once", "time_call", "progress", "median",
           "load_average", "spawn_ranks", "init_rank", "random_qkv", "start_clocks", "since"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(name: str | None) -> torch.device:
    """``None``/"auto": CUDA when available, else CPU."""
    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def pick_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """``None``/"auto": bfloat16 on CUDA, float32 on CPU (the CPU fused kernel is fastest in fp32)."""
    if name in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r}: expected one of {sorted(DTYPES)} or 'auto'")
    return DTYPES[name]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median(xs: Iterable[float]) -> float:
    return statistics.median(list(xs))


def clock_for(device: torch.device, threads: int | None) -> Callable[[], float]:
    """The clock of the simulator: on a CPU with one compute thread, the CPU time of this process
    (``time.process_time``), which load from other processes on a shared machine does not inflate;
    otherwise wall time (after a device sync)."""
    if device.type == "cpu" and threads == 1:
        return time.process_time
    return time.perf_counter


def time_once(fn: Callable[[], object], device: torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of one ``fn()`` on ``clock``, the device synchronised before and after."""
    sync(device)
    t0 = clock()
    fn()
    sync(device)
    return clock() - t0


def start_clocks() -> tuple[float, float]:
    """Wall time and this process's CPU time now, for :func:`since`."""
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float], device: torch.device) -> torch.Tensor:
    """Seconds since ``start`` (:func:`start_clocks`) as a float tensor ``[wall, cpu]`` on ``device``, for
    a reduction over the ranks: the wall time, and the process's CPU time (its threads, gloo's copies
    included), which under load from other jobs on a shared machine still ranks the busiest rank."""
    return torch.tensor([time.perf_counter() - start[0], time.process_time() - start[1]], device=device)


def time_call(fn: Callable[[], object], device: torch.device, reps: int = 3, long_s: float = 1.0,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up run (never counted).

    When the warm-up takes longer than ``long_s``, ``max(2, reps // 2)`` samples are taken.
    """
    first = time_once(fn, device, clock)
    want = max(2, reps // 2) if first > long_s else reps
    return median([time_once(fn, device, clock) for _ in range(want)])


def random_qkv(batch: int, tokens: int, heads: int, kv_heads: int, head_dim: int, device, dtype: torch.dtype,
               generator: torch.Generator | None = None, grad: bool = True) -> tuple:
    """Random ``q, k, v, dout`` of ``[batch, tokens, h, head_dim]`` (``h``: ``heads`` for q and dout,
    ``kv_heads`` for k and v), drawn in float32 on the CPU in that order (from ``generator``, else the
    global RNG) and moved to ``device`` / ``dtype``; q, k and v require grad when ``grad``."""
    q, k, v, dout = (torch.randn((batch, tokens, h, head_dim), generator=generator).to(device, dtype)
                     for h in (heads, kv_heads, kv_heads, heads))
    if grad:
        q, k, v = q.requires_grad_(), k.requires_grad_(), v.requires_grad_()
    return q, k, v, dout


def progress(iterable, total: int | None = None, desc: str = "", enabled: bool = True):
    """A tqdm bar on stderr when tqdm is installed (the ``bench`` extra), else the bare iterable."""
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)


def load_average() -> str:
    """The 1-minute load average, formatted (``"?"`` where the platform has none)."""
    import os

    try:
        return f"{os.getloadavg()[0]:.1f}"
    except OSError:
        return "?"


def spawn_ranks(target: Callable, args: tuple, world_size: int, timeout_s: float, what: str) -> dict:
    """Run ``target(rank, *args, init_file, results)`` in ``world_size`` spawned processes and
    collect what each puts on ``results``: ``("ok", rank, payload)``, or ``("error", rank, text)``, which
    an exception out of ``target`` puts there (its traceback: :func:`_report_errors`).

    ``init_file`` is a fresh file for ``init_method="file://..."``.  Returns ``{rank: payload}``;
    the first error (or no result within ``timeout_s``) raises ``RuntimeError`` naming ``what``,
    after the processes were joined or killed."""
    import os
    import queue
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    got, errors = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs = [ctx.Process(target=_report_errors, args=(target, r, *args, init_file, results))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            while len(got) + len(errors) < world_size and not errors:
                status, rank, payload = results.get(timeout=timeout_s)
                if status == "ok":
                    got[rank] = payload
                else:
                    errors.append(f"rank {rank}: {payload}")
        except queue.Empty:
            errors.append(f"no result within {timeout_s}s")
        finally:
            for p in procs:
                p.join(timeout=10 if errors else 120)
                if p.is_alive():
                    p.kill()
    if errors:
        raise RuntimeError(f"{what} failed:\n" + "\n".join(errors))
    return got


def _report_errors(target: Callable, rank: int, *args) -> None:
    """A process of :func:`spawn_ranks`: ``target(rank, *args)``, an exception reported to the parent as
    ``("error", rank, traceback)`` on the results queue (the last of ``args``)."""
    try:
        target(rank, *args)
    except BaseException:  # noqa: BLE001 - reported to the parent
        import traceback

        args[-1].put(("error", rank, traceback.format_exc()))


def init_rank(rank: int, world_size: int, device_type: str, init_file: str, timeout_s: float,
              threads: int | None = None, pin: bool = True) -> torch.device:
    """In a process of :func:`spawn_ranks`: its device and its process group (gloo on CPU, NCCL on
    CUDA, ``init_method="file://init_file"``).  On CPU: ``threads`` compute threads (default
    cores // world_size), pinned to the rank's own cores when there are enough (no migrations
    between the ranks' threads)."""
    import datetime
    import os

    import torch.distributed as dist

    if device_type == "cpu":
        threads = threads or max(1, (os.cpu_count() or 1) // world_size)
        torch.set_num_threads(threads)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if pin and len(cores) >= world_size * threads:
            os.sched_setaffinity(0, cores[rank * threads:(rank + 1) * threads])
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        device, backend = torch.device("cpu"), "gloo"
    else:
        torch.cuda.set_device(rank)
        device, backend = torch.device("cuda", rank), "nccl"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s),
                            **({"device_id": device} if device_type == "cuda" else {}))
    return device
