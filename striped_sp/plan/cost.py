"""Cost models, one per kernel: the predicted time of an attention call, for every ``auto`` choice
and for a plan's predicted cost.

A model predicts one call's forward time per head from its shape (:class:`CostModel`), and a whole
ring's forward+backward time from its steps (:meth:`CostModel.ring_ns`: compute, the transfer of
the rows the ring carries, hidden behind compute where it is shorter, and a fixed cost per step).
The table (:data:`COST_MODELS`) holds PyTorch's CPU flash op and the matmul reference on the CPU
(measured) and a tile model for flash kernels on GPUs (a prediction, labelled as such wherever it
decides); :func:`model_for_kernel` says which prices each kernel on each device type.
:func:`model_for` is the model a kernel runs by: the one adopted with :func:`use_model` where it was
calibrated for that kernel on that device type, else the table's; :func:`default_model` is that of
``backend="auto"`` on the process's device type (every rank of a job gets the same answer, so
placements decided from it agree).  :func:`calibrate` fits a measured model on the running device
from a few timed calls (opt-in: timings differ slightly between ranks, so a calibrated model is
measured on one rank and handed to every rank:
:func:`striped_sp.engine.calibration.calibrate_cost_model` does both and adopts it, :func:`use_model`).
"""

from __future__ import annotations

import dataclasses
import time

import torch

__all__ = ["CostModel", "COST_MODELS", "default_model", "model_named", "model_for_kernel", "model_for", "calibrate",
           "fitted_model", "use_model"]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Predicted time of one attention kernel call (forward, per head), in nanoseconds:
    ``ns_per_entry * entries * (1 + small_rows / rows) + call_ns``, where a causal call of ``m``
    rows computes ``m * min(m, m / 2 + causal_waste)`` entries (the kernel skips masked keys only
    in tiles, wasting about ``causal_waste`` entries per row on the diagonal; ``inf``: the whole
    square).  Frozen and compared on every field: a model is part of the cache keys of the choices
    made with it (:mod:`striped_sp.plan.search`, the plan cache)."""

    name: str
    ns_per_entry: float
    small_rows: float
    causal_waste: float
    call_ns: float
    measured: bool
    #: backward time over forward time of the same calls (flash backward recomputes the scores)
    backward_factor: float = 2.5
    #: one key/value row's transfer per head (head_dim 64, K and V), in ns: the ring's link
    transfer_ns_per_row: float = 1.0
    #: fixed cost of one ring step per head, both passes (launch, wait, accumulator update)
    step_ns: float = 0.0
    #: whether a transfer runs beside the compute (GPU copy engines) or takes its time from it (CPU
    #: ranks, whose cores run gloo's copies too)
    overlaps_transfer: bool = True
    #: host time of one more kernel call in a scheduled varlen program, one pass (its slices, its
    #: dispatch, its share of the merge), whatever the heads: what a schedule's extra call costs
    host_ns_per_call: float = 25_000.0
    #: host time of one more batched call, one pass (its gathers, its gradient scatters, the padding
    #: rows' fills): what splitting squares into one more size class costs beside their compute
    #: (measured here: 100-250 us for both passes at 1 head of 8, 7 batches against 1)
    host_ns_per_batch: float = 75_000.0
    #: the kernel (its ``name``) and device type this model was measured for, ``""``: none in
    #: particular (a prediction); a model adopted with :func:`use_model` prices that kernel there only
    kernel: str = ""
    device_type: str = ""

    @property
    def label(self) -> str:
        """The name, with ``" (a prediction)"`` where the model was not measured."""
        return self.name + ("" if self.measured else " (a prediction)")

    def call(self, rows: float, keys: float, causal: bool) -> float:
        if rows <= 0 or keys <= 0:
            return 0.0
        entries = rows * min(keys, rows / 2 + self.causal_waste) if causal else rows * keys
        return self.ns_per_entry * entries * (1 + self.small_rows / rows) + self.call_ns

    def call_tensor(self, rows: torch.Tensor, keys: torch.Tensor, causal: bool) -> torch.Tensor:
        """:meth:`call` element by element (float tensors of rows and keys; 0 where either is below
        1), for the per-document predictions of :mod:`striped_sp.plan.doc_stripes`."""
        rows = torch.clamp(rows, min=1e-9)
        area = rows * torch.minimum(keys, rows / 2 + self.causal_waste) if causal else rows * keys
        ns = self.ns_per_entry * area * (1 + self.small_rows / rows) + self.call_ns
        return torch.where((rows >= 1) & (keys >= 1), ns, torch.zeros_like(ns))

    def segments_ns(self, segs) -> float:
        """The summed forward time of a call's band segments
        (:class:`~striped_sp.kernels.segments.Segments`): the exact visible entries of each, plus
        ``causal_waste`` per row where the band has a diagonal edge inside the block (tiles skip
        masked keys only whole)."""
        return float(self.each_segment_ns(segs).sum())

    def each_segment_ns(self, segs) -> torch.Tensor:
        """:meth:`segments_ns` of each segment (float64 ``[segments]``)."""
        lq, lk = segs.lq, segs.lk
        if lq.numel() == 0:
            return torch.zeros(0, dtype=torch.float64)
        lo, hi = segs.offsets()
        visible = segs.segment_entries().double()
        rows, keys = lq.double(), lk.double()
        edged = (lo > -lq) | (hi < lk - 1)
        area = torch.minimum(rows * keys, visible + torch.where(edged, self.causal_waste * rows, torch.zeros_like(rows)))
        live = (lq > 0) & (lk > 0) & (visible > 0)
        safe = torch.clamp(rows, min=1.0)
        ns = self.ns_per_entry * area * (1 + self.small_rows / safe) + self.call_ns
        return torch.where(live, ns, torch.zeros_like(ns))

    def ring_ns(self, compute_ns, carried_rows) -> float:
        """Forward+backward time per head of a ring whose step ``t`` computes ``compute_ns[t]``
        (forward, on the slowest rank) and then takes the ``carried_rows[t]`` key/value rows of the
        next step (0 after the last step): a transfer (forward: K/V; backward: K/V and dK/dV, twice
        the bytes) overlaps the step's compute where :attr:`overlaps_transfer`, else adds to it; each
        step pays :attr:`step_ns`."""
        join = max if self.overlaps_transfer else (lambda a, b: a + b)
        total = 0.0
        for ns, rows in zip(compute_ns, carried_rows):
            fwd = join(ns, rows * self.transfer_ns_per_row)
            bwd = join(ns * self.backward_factor, 2 * rows * self.transfer_ns_per_row)
            total += fwd + bwd + self.step_ns
        return total

    def calls(self, rows: torch.Tensor, keys: torch.Tensor, causal: torch.Tensor) -> float:
        """The summed :meth:`call` of many calls (tensors of rows, keys and causal flags)."""
        rows, keys = rows.double(), keys.double()
        live = (rows > 0) & (keys > 0)
        safe = torch.clamp(rows, min=1.0)
        entries = torch.where(causal, safe * torch.minimum(keys, safe / 2 + self.causal_waste), safe * keys)
        ns = self.ns_per_entry * entries * (1 + self.small_rows / safe) + self.call_ns
        return float(torch.where(live, ns, torch.zeros_like(ns)).sum())


#: the table (read only): models by name, each measured on one kernel and device type or a prediction
COST_MODELS = {
    # measured here: PyTorch's CPU flash op, fp32, head_dim 64, one thread (docs/tuning.md, "Whole-document placement")
    # the backward factor and the transfer fitted on 2 gloo ranks, 4096 tokens each, fwd+bwd of 36
    # plans (docs/tuning.md, "Choosing a plan"): 1 us per K/V row and head, not hidden by compute
    "cpu": CostModel("cpu", 3.9, 60.0, 256.0, 20_000.0, True, backward_factor=3.0, transfer_ns_per_row=1000.0,
                     step_ns=50_000.0, overlaps_transfer=False, kernel="torch", device_type="cpu"),
    # measured here: the matmul reference (backend="math"), fp32, head_dim 64, one thread of this 2-core
    # CPU, forward of 32-1024 rows, fastest of 15: 4.6-5.4 ns per entry from 512 rows, 40 us for 32
    # rows (a fixed cost); a causal call computes its whole square and then masks it (1.3-1.8x a full
    # call of its shape: causal_waste inf); backward 1.3-1.9x forward.  Ring terms: the gloo CPU's above
    "math_cpu": CostModel("math_cpu", 5.0, 0.0, float("inf"), 35_000.0, True, backward_factor=1.9,
                          transfer_ns_per_row=1000.0, step_ns=50_000.0, overlaps_transfer=False, kernel="math",
                          device_type="cpu"),
    # a prediction, not a measurement: flash-attn 2/3 style tiles of 128 rows on a GPU; NVLink-class link
    "flash_attn": CostModel("flash_attn", 0.01, 128.0, 64.0, 5_000.0, False, backward_factor=2.5,
                            transfer_ns_per_row=1.0, step_ns=20_000.0),
}

#: which table model prices each kernel (``"auto"``: what ``backend="auto"`` runs) on each device
#: type (read only); pairs not listed fall back by device type (:func:`model_for_kernel`)
_KERNEL_MODELS = {
    ("auto", "cpu"): "cpu",  # auto on the CPU: PyTorch's op for every float dtype
    ("torch", "cpu"): "cpu",
    ("math", "cpu"): "math_cpu",
    ("auto", "cuda"): "flash_attn",  # flash-attn, else PyTorch's fused ops: tiles either way
    ("flash_attn", "cuda"): "flash_attn",
    ("torch", "cuda"): "flash_attn",  # PyTorch's CUDA flash / memory-efficient ops: tiles
    ("torch_cudnn", "cuda"): "flash_attn",
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
    """The table's model for a kernel (its ``name``, or ``"auto"``) on a device type: PyTorch's CPU
    op and the matmul reference each by their own measured model on ``cpu``, the flash tile model (a
    prediction) for the fused kernels on ``cuda``.  Not measured, so predictions: the matmul
    reference on a GPU (kept for checking, not planned for: calibrate it to plan by its times) and
    every kernel on another device type (``meta``: dry runs of the CUDA path) take the flash tile
    model; a kernel the table does not know on ``cpu`` takes the CPU op's, labelled a prediction."""
    key = _KERNEL_MODELS.get((kernel_name, device_type))
    if key is not None:
        return COST_MODELS[key]
    if device_type == "cpu":
        return dataclasses.replace(COST_MODELS["cpu"], measured=False, kernel="", device_type="")
    return COST_MODELS["flash_attn"]


#: the model every rank adopted with :func:`use_model` (a calibration, measured once and handed to
#: all ranks: :func:`striped_sp.engine.calibration.calibrate_cost_model`); ``None``: the table's.
#: Process state because every ``auto`` choice and plan compilation must see the one adopted model.
_ADOPTED: list = [None]


def use_model(model: CostModel | None) -> None:
    """Adopt ``model`` for the kernel and device type it was measured for (:attr:`CostModel.kernel`,
    :attr:`CostModel.device_type`; ``None``: back to the table's): :func:`model_for` and
    :func:`default_model` return it there.  Every rank must adopt the same model before its first
    batch, or ranks would place documents differently."""
    if model is not None and not isinstance(model, CostModel):
        raise ValueError(f"use_model({model!r}): expected a CostModel or None")
    if model is not None and not (model.kernel and model.device_type):
        raise ValueError(f"use_model(): model {model.name!r} names no kernel and device type (CostModel.kernel, "
                         "device_type) that it was measured for: it would price nothing (see calibrate())")
    _ADOPTED[0] = model


def model_for(kernel_name: str, device_type: str) -> CostModel:
    """The model ``kernel_name`` runs by on ``device_type``: the adopted one (:func:`use_model`)
    where it was measured for that kernel on that device type, else the table's
    (:func:`model_for_kernel`).  ``kernel_name`` ``"auto"`` (the placement of ``backend="auto"``,
    which resolves its kernel per dtype): the adopted one where it was measured on that device type,
    whatever kernel ``calibrate_cost_model`` resolved."""
    adopted = _ADOPTED[0]
    if adopted is not None and adopted.device_type == device_type and kernel_name in ("auto", adopted.kernel):
        return adopted
    return model_for_kernel(kernel_name, device_type)


def default_model() -> CostModel:
    """The model of the kernel this process runs by default (``backend="auto"``) on its device type
    (``cuda`` where available, else ``cpu``): :func:`model_for`."""
    return model_for("auto", "cuda" if torch.cuda.is_available() else "cpu")


def fitted_model(kernel_name: str, device_type: str, ns_per_entry: float, causal_waste: float,
                 call_ns: float) -> CostModel:
    """The measured model :func:`calibrate` returns for a kernel on a device type from its fitted
    numbers (also how ranks that did not time rebuild the first rank's model): the table's model of
    that kernel and device type (:func:`model_for_kernel`) for the rest, named
    ``"<kernel>@<device type>"``."""
    return dataclasses.replace(model_for_kernel(kernel_name, device_type), name=f"{kernel_name}@{device_type}",
                               ns_per_entry=ns_per_entry, causal_waste=causal_waste, call_ns=call_ns, measured=True,
                               kernel=kernel_name, device_type=device_type)


def calibrate(kernel, device, dtype=torch.float32, head_dim: int = 64, heads: int = 1, sizes=(64, 256, 1024),
              reps: int = 3) -> CostModel:
    """A measured :class:`CostModel` for ``kernel`` on ``device``: full and causal calls of
    ``sizes`` rows timed (median of ``reps``, forward), then ``ns_per_entry`` and ``call_ns`` fitted
    by least squares on the full calls, ``causal_waste`` from the causal ones; ``small_rows`` and the
    ring terms (backward factor, transfer, step) are kept from the table's model of that kernel and
    device type (:func:`fitted_model`; ``causal_waste`` ``inf`` where every causal call cost its
    whole square).  Adopt it with :func:`use_model`: it then prices that kernel on that device type."""
    device = torch.device(device)
    name = getattr(kernel, "name", "") or "kernel"
    base = model_for_kernel(name, device.type)

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
    whole = all(w >= m / 2 for w, m in zip(wastes, sizes))  # masks after computing the square (math)
    return fitted_model(name, device.type, slope, float("inf") if whole else sum(wastes) / len(wastes), call_ns)
