"""Peak memory of PyTorch allocations over a region of code, on CPU or CUDA.

``with MemoryPeak(device) as mem: ...`` then ``mem.peak``: the highest number of bytes held by
tensors allocated inside the region, above what was held at its start.  Tensors alive before the
region (the inputs) are not counted, nor are their frees inside it (CPU: the profiler never saw
them allocated); callers add the inputs' sizes.

* CUDA: the caching allocator's own statistics (``torch.cuda.reset_peak_memory_stats``,
  ``max_memory_allocated`` minus ``memory_allocated`` at entry).
* CPU: torch has no CPU allocator statistics (torch 2.13: no ``torch.cpu.memory_stats``), so the
  region runs under ``torch.profiler`` with ``profile_memory=True``, which records every
  allocation and free of PyTorch's CPU allocator with its size and time, also those made inside
  fused ops (the CPU flash kernel's per-thread buffers), in autograd's backward and for gloo's
  receive buffers; the running sum of those events, in time order, peaks at ``peak``.  It is
  exact (no sampling, no page granularity) and deterministic for a deterministic program.
  ``tracemalloc`` sees no tensor memory, and ``ru_maxrss`` / RSS counts pages the C allocator
  keeps cached, the interpreter and the libraries, and cannot be reset inside a process.
  Not counted: memory that libraries allocate outside PyTorch's allocator (gloo's own buffers).
"""

from __future__ import annotations

import torch

__all__ = ["MemoryPeak", "tensor_bytes"]


def tensor_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the storage the tensors' elements take (``numel * element_size``)."""
    return sum(t.numel() * t.element_size() for t in tensors)


class MemoryPeak:
    """Context manager: ``peak`` (bytes) of tensor memory allocated inside the region, above the
    level at its start; ``end``: the level at its end (negative when it freed more than it kept)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak = 0
        self.end = 0
        self._prof = None
        self._start = 0

    def __enter__(self) -> "MemoryPeak":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
            self.end = torch.cuda.memory_allocated(self.device) - self._start
            return
        self._prof.__exit__(*exc)
        if exc[0] is None:
            self.peak, self.end = _cpu_peak(self._prof)

    @property
    def peak_mib(self) -> float:
        return self.peak / 2**20


def _cpu_peak(prof) -> tuple[int, int]:
    results = getattr(prof.profiler, "kineto_results", None)
    if results is None:  # pragma: no cover - a torch whose profiler lost this (private) attribute
        raise RuntimeError(f"torch {torch.__version__}: the profiler has no kineto_results: cannot read the "
                           "allocation events (striped_sp.bench.memory)")
    events = sorted((e.start_ns(), e.nbytes()) for e in results.events() if e.name() == "[memory]")
    level = peak = 0
    for _, nbytes in events:
        level += nbytes
        peak = max(peak, level)
    return peak, level
