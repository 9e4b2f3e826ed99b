"""Cost models, one per kernel: the predicted time of an attention call, for every ``auto`` choice
and for a plan's predicted cost.

A model predicts one call's forward time per head from its shape (:class:`CostModel`); the table
holds PyTorch's CPU flash op (measured) and a tile model for flash kernels on GPUs (a prediction,
labelled as such wherever it decides).  :func:`default_model` is the model of the kernel a process
will run: the flash tile model where CUDA is available, else the CPU one; every rank of a job gets
the same answer, so placements decided from it agree.  :func:`calibrate` fits a measured model on
the running device from a few timed calls (opt-in: timings differ slightly between ranks, so a
calibrated model must be measured once and handed to every rank, e.g. by ``describe(model=)`` or
``choose_whole_max(model=)``).
"""

from __future__ import annotations

import dataclasses
import time

import torch

__all__ = ["CostModel", "COST_MODELS", "default_model", "model_named", "model_for_kernel", "calibrate"]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Predicted time of one attention kernel call (forward, per head), in nanoseconds:
    ``ns_per_entry * entries * (1 + small_rows / rows) + call_ns``, where a causal call of ``m``
    rows computes ``m * min(m, m / 2 + causal_waste)`` entries (the kernel skips masked keys only
    in tiles, wasting about ``causal_waste`` entries per row on the diagonal)."""

    name: str
    ns_per_entry: float
    small_rows: float
    causal_waste: float
    call_ns: float
    measured: bool

    def call(self, rows: float, keys: float, causal: bool) -> float:
        if rows <= 0 or keys <= 0:
            return 0.0
        entries = rows * min(keys, rows / 2 + self.causal_waste) if causal else rows * keys
        return self.ns_per_entry * entries * (1 + self.small_rows / rows) + self.call_ns

    def calls(self, rows: torch.Tensor, keys: torch.Tensor, causal: torch.Tensor) -> float:
        """The summed :meth:`call` of many calls (tensors of rows, keys and causal flags)."""
        rows, keys = rows.double(), keys.double()
        live = (rows > 0) & (keys > 0)
        safe = torch.clamp(rows, min=1.0)
        entries = torch.where(causal, safe * torch.minimum(keys, safe / 2 + self.causal_waste), safe * keys)
        ns = self.ns_per_entry * entries * (1 + self.small_rows / safe) + self.call_ns
        return float(torch.where(live, ns, torch.zeros_like(ns)).sum())


COST_MODELS = {
    # measured here: PyTorch's CPU flash op, fp32, head_dim 64, one thread (docs/tuning.md, "Whole-document placement")
    "cpu": CostModel("cpu", 3.9, 60.0, 256.0, 20_000.0, True),
    # a prediction, not a measurement: flash-attn 2/3 style tiles of 128 rows on a GPU
    "flash_attn": CostModel("flash_attn", 0.01, 128.0, 64.0, 5_000.0, False),
}


def model_named(model: "CostModel | str | None") -> CostModel:
    """``model`` itself, the table's model of that name, or (``None``) :func:`default_model`."""
    if model is None:
        return default_model()
    if isinstance(model, CostModel):
        return model
    if model not in COST_MODELS:
        raise ValueError(f"unknown cost model {model!r}: expected one of {sorted(COST_MODELS)}")
    return COST_MODELS[model]


def model_for_kernel(kernel_name: str, device_type: str) -> CostModel:
    """The table's model for a kernel on a device type: the CPU op's on ``cpu``, the flash tile
    model (a prediction) for every fused kernel on a GPU."""
    return COST_MODELS["cpu"] if device_type == "cpu" else COST_MODELS["flash_attn"]


def default_model() -> CostModel:
    """The model of the kernel this process runs by default (``backend="auto"``)."""
    return model_for_kernel("auto", "cuda" if torch.cuda.is_available() else "cpu")


def calibrate(kernel, device, dtype=torch.float32, head_dim: int = 64, heads: int = 1, sizes=(64, 256, 1024),
              reps: int = 3) -> CostModel:
    """A measured :class:`CostModel` for ``kernel`` on ``device``: full and causal calls of
    ``sizes`` rows timed (median of ``reps``, forward), then ``ns_per_entry`` and ``call_ns`` fitted
    by least squares on the full calls, ``causal_waste`` from the causal ones; ``small_rows`` is kept
    from the table's model of that device type."""
    device = torch.device(device)
    base = model_for_kernel(getattr(kernel, "name", ""), device.type)

    def timed(m: int, causal: bool) -> float:
        q = torch.randn(1, m, heads, head_dim, device=device, dtype=dtype)
        samples = []
        for _ in range(reps + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            kernel.forward(q, q, q, causal, head_dim ** -0.5)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append((time.perf_counter() - t0) * 1e9 / heads)
        return sorted(samples[1:])[len(samples[1:]) // 2]

    full = [(m * m * (1 + base.small_rows / m), timed(m, False)) for m in sizes]
    n = len(full)
    sx, sy = sum(x for x, _ in full), sum(y for _, y in full)
    sxx, sxy = sum(x * x for x, _ in full), sum(x * y for x, y in full)
    slope = max((n * sxy - sx * sy) / max(n * sxx - sx * sx, 1e-12), 1e-6)
    call_ns = max((sy - slope * sx) / n, 0.0)
    wastes = []
    for m in sizes:
        entries = (timed(m, True) - call_ns) / (slope * (1 + base.small_rows / m)) / m  # entries per row
        wastes.append(min(max(entries - m / 2, 0.0), m / 2))
    return CostModel(f"{getattr(kernel, 'name', 'kernel')}@{device.type}", slope, base.small_rows,
                     sum(wastes) / len(wastes), call_ns, True)
