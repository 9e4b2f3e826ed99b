"""Helpers shared by the benchmark modes: devices, dtypes, timing, progress bars."""

from __future__ import annotations

import statistics
import sys
import time
from typing import Callable, Iterable

import torch

__all__ = ["DTYPES", "pick_device", "pick_dtype", "sync", "clock_for", "time_once", "time_call", "progress", "median"]

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


def time_call(fn: Callable[[], object], device: torch.device, reps: int = 3, long_s: float = 1.0,
              clock: Callable[[], float] = time.perf_counter) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up run (never counted).

    When the warm-up takes longer than ``long_s``, ``max(2, reps // 2)`` samples are taken.
    """
    first = time_once(fn, device, clock)
    want = max(2, reps // 2) if first > long_s else reps
    return median([time_once(fn, device, clock) for _ in range(want)])


def progress(iterable, total: int | None = None, desc: str = "", enabled: bool = True):
    """A tqdm bar on stderr when tqdm is installed (the ``bench`` extra), else the bare iterable."""
    if not enabled:
        return iterable
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return iterable
    return tqdm(iterable, total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True)
