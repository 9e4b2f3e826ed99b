"""Cost models, one per kernel: the predicted time of an attention call, for every ``auto`` choice
and for a plan's predicted cost.

A model predicts one call's forward time per head from its shape (:class:`CostModel`), and a whole
ring's forward+backward time from its steps (:meth:`CostModel.ring_ns`: compute, the transfer of
the rows the ring carries, hidden behind compute where it is shorter, and a fixed cost per step);
the table
holds PyTorch's CPU flash op (measured) and a tile model for flash kernels on GPUs (a prediction,
labelled as such wherever it decides).  :func:`default_model` is the model of the kernel a process
will run: the flash tile model where CUDA is available, else the CPU one; every rank of a job gets
the same answer, so placements decided from it agree.  :func:`calibrate` fits a measured model on
the running device from a few timed calls (opt-in: timings differ slightly between ranks, so a
calibrated model is measured on one rank and handed to every rank:
:func:`striped_sp.engine.calibration.calibrate_cost_model` does both and adopts it, :func:`use_model`).
"""

from __future__ import annotations

import dataclasses
import time

import torch

__all__ = ["CostModel", "COST_MODELS", "default_model", "model_named", "model_for_kernel", "calibrate", "use_model"]


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


COST_MODELS = {
    # measured here: PyTorch's CPU flash op, fp32, head_dim 64, one thread (docs/tuning.md, "Whole-document placement")
    # the backward factor and the transfer fitted on 2 gloo ranks, 4096 tokens each, fwd+bwd of 36
    # plans (docs/tuning.md, "Choosing a plan"): 1 us per K/V row and head, not hidden by compute
    "cpu": CostModel("cpu", 3.9, 60.0, 256.0, 20_000.0, True, backward_factor=3.0, transfer_ns_per_row=1000.0,
                     step_ns=50_000.0, overlaps_transfer=False),
    # a prediction, not a measurement: flash-attn 2/3 style tiles of 128 rows on a GPU; NVLink-class link
    "flash_attn": CostModel("flash_attn", 0.01, 128.0, 64.0, 5_000.0, False, backward_factor=2.5,
                            transfer_ns_per_row=1.0, step_ns=20_000.0),
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


#: the model every rank adopted with :func:`use_model` (a calibration, measured once and handed to
#: all ranks: :func:`striped_sp.engine.calibration.calibrate_cost_model`); ``None``: the table's
_ADOPTED: list = [None]


def use_model(model: CostModel | None) -> None:
    """Make ``model`` the process's :func:`default_model` (``None``: back to the table's).  Every rank
    must adopt the same model before its first batch, or ranks would place documents differently."""
    if model is not None and not isinstance(model, CostModel):
        raise ValueError(f"use_model({model!r}): expected a CostModel or None")
    _ADOPTED[0] = model


def default_model() -> CostModel:
    """The model of the kernel this process runs by default (``backend="auto"``): the adopted one
    (:func:`use_model`), else the table's for the device."""
    if _ADOPTED[0] is not None:
        return _ADOPTED[0]
    return model_for_kernel("auto", "cuda" if torch.cuda.is_available() else "cpu")


def calibrate(kernel, device, dtype=torch.float32, head_dim: int = 64, heads: int = 1, sizes=(64, 256, 1024),
              reps: int = 3) -> CostModel:
    """A measured :class:`CostModel` for ``kernel`` on ``device``: full and causal calls of
    ``sizes`` rows timed (median of ``reps``, forward), then ``ns_per_entry`` and ``call_ns`` fitted
    by least squares on the full calls, ``causal_waste`` from the causal ones; ``small_rows`` and the
    ring terms (backward factor, transfer, step) are kept from the table's model of that device type."""
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
    return dataclasses.replace(base, name=f"{getattr(kernel, 'name', 'kernel')}@{device.type}", ns_per_entry=slope,
                               causal_waste=sum(wastes) / len(wastes), call_ns=call_ns, measured=True)
