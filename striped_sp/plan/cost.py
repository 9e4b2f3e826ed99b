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
import functools
import time

import torch

__all__ = ["CostModel", "COST_MODELS", "default_model", "model_named", "model_for_kernel", "model_for", "calibrate",
           "fitted_model", "use_model", "gpu_model", "gpu_arch", "cuda_kernel_class", "GPU_ARCHS", "DEFAULT_ARCH"]


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
    #: the accumulator work of one query row per head of 64 in one ring step, forward (the merge of
    #: (out, lse) into fp32; the backward's dq/dk/dv accumulation counts twice that): memory-bound on
    #: a GPU, where it is a step's main cost beside the kernels (0: folded into ``step_ns``)
    merge_ns_per_row: float = 0.0
    #: the GPU architecture of a GPU model (``"H100"``, ...; :data:`GPU_ARCHS`), ``""``: none
    arch: str = ""
    #: per-call efficiency of a diagonal-masked call: the cost of one entry of a causal call (or of a
    #: masked segment with a diagonal edge, the strided blocks of stripes of 1) over one of a full
    #: call of the same rows (1.0: the same; ``bench fit`` fits it from measured CPU timings)
    causal_factor: float = 1.0

    @property
    def label(self) -> str:
        """The name, with ``" (a prediction)"`` where the model was not measured."""
        return self.name + ("" if self.measured else " (a prediction)")

    def call(self, rows: float, keys: float, causal: bool) -> float:
        if rows <= 0 or keys <= 0:
            return 0.0
        entries = rows * min(keys, rows / 2 + self.causal_waste) * self.causal_factor if causal else rows * keys
        return self.ns_per_entry * entries * (1 + self.small_rows / rows) + self.call_ns

    def call_tensor(self, rows: torch.Tensor, keys: torch.Tensor, causal: bool) -> torch.Tensor:
        """:meth:`call` element by element (float tensors of rows and keys; 0 where either is below
        1), for the per-document predictions of :mod:`striped_sp.plan.doc_stripes`."""
        rows = torch.clamp(rows, min=1e-9)
        area = rows * torch.minimum(keys, rows / 2 + self.causal_waste) * self.causal_factor if causal else rows * keys
        ns = self.ns_per_entry * area * (1 + self.small_rows / rows) + self.call_ns
        return torch.where((rows >= 1) & (keys >= 1), ns, torch.zeros_like(ns))

    def rect_factors(self, rows: torch.Tensor, keys: torch.Tensor) -> list:
        """A dense call's time (:meth:`call_tensor`, ``causal=False``) as a sum of products of a
        function of the rows and one of the keys: ``[(f(rows), g(keys)), ...]`` with
        ``sum(f * g) == call_tensor(rows, keys, False)`` element by element (broadcast), so that
        sums of calls over many pairs are matrix products (:func:`~striped_sp.plan.doc_stripes.step_cost`)."""
        live_r, live_k = (rows >= 1).to(rows.dtype), (keys >= 1).to(keys.dtype)
        return [(self.ns_per_entry * (rows + self.small_rows) * live_r, keys * live_k), (self.call_ns * live_r, live_k)]

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
        area = torch.where(edged, area * self.causal_factor, area)
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
        entries = torch.where(causal, safe * torch.minimum(keys, safe / 2 + self.causal_waste) * self.causal_factor,
                              safe * keys)
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
}

#: GPU architectures of the predicted models (read only): the ring link one way in GB/s as a
#: ring's point-to-point copies reach it (about 80% of NVLink's per-direction figure: A100 NVLink3
#: 300, H100/H200 NVLink4 450, H800 200, B200 NVLink5 900) and HBM in TB/s (vendor sheets)
GPU_ARCHS = {"A100": (240.0, 2.0), "H100": (360.0, 3.35), "H800": (160.0, 3.35), "H200": (360.0, 4.8),
             "B200": (720.0, 8.0)}
#: the architecture predictions are made for where no GPU says otherwise (dry runs on ``meta``)
DEFAULT_ARCH = "H100"

#: published kernel throughput, bf16, head_dim 128, 8k tokens, TFLOP/s (read only): (forward,
#: causal forward, backward) per kernel class and architecture.  H100 (and H800 / H200, the same
#: SMs and clocks): FlashAttention-3's paper (Shah et al. 2024, H100 SXM5 figures): FA2 370 / 333 /
#: 318, cuDNN 600 / 529 / 518, FA3 646 / 602 / 559; FA4's SM90 path taken as FA3's.  A100: FA2
#: from ring-flash-attention's single-GPU flash_attn run (8xA100: 373.4 fwd it/s, 94.7 fwd+bwd, 8k
#: causal, 32 x 128: 205 causal TFLOP/s, backward 2.94x the forward).  B200: FlashAttention-4's
#: reported forward (up to ~1.6 PFLOP/s, 1.1-1.3x cuDNN); the memory-efficient op, FA2 on B200
#: and cuDNN on A100 are estimates (no published figure at this shape): guesses, labelled so.
_PUBLISHED = {
    ("fa2", "H100"): (370.0, 333.0, 318.0), ("cudnn", "H100"): (600.0, 529.0, 518.0),
    ("fa3", "H100"): (646.0, 602.0, 559.0), ("fa4", "H100"): (646.0, 602.0, 559.0),
    ("efficient", "H100"): (230.0, 200.0, 190.0),
    ("fa2", "A100"): (228.0, 205.0, 194.0), ("cudnn", "A100"): (228.0, 205.0, 194.0),
    ("efficient", "A100"): (150.0, 130.0, 120.0),
    ("fa4", "B200"): (1500.0, 1400.0, 1150.0), ("cudnn", "B200"): (1300.0, 1200.0, 1000.0),
    ("fa2", "B200"): (550.0, 495.0, 470.0), ("efficient", "B200"): (350.0, 310.0, 290.0),
}
#: the kernel class whose figures a class without its own takes (``torch_flash``: PyTorch's
#: vendored FA2; FA3 only runs on Hopper; FA4 not on Ampere)
_CLASS_FALLBACK = {"torch_flash": "fa2", "fa3": "fa2", "fa4": "fa2", "cudnn": "fa2", "efficient": "fa2"}
#: one kernel launch and its tail, ns (spread over the 64 units of 32 heads of 128: the model's
#: per-head-of-64 convention), and a ring step's fixed cost beside its kernels (the merge's
#: launches, the transfer's posting and wait), ns per step
_GPU_LAUNCH_NS, _GPU_STEP_NS = 5_000.0, 30_000.0
#: bytes moved per query row and head of 64 by one step's forward merge (fp32 out read and written,
#: the block's bf16 out and the lse read, in unfused elementwise ops: about 5 passes); the backward
#: moves twice that (dq, dk and dv accumulated).  The one number fitted: to ring-flash-attention's
#: 8xH800 fwd+bwd figures (docs/results.md, "GPU cost models against published figures")
_MERGE_BYTES_PER_ROW = 3_200.0


def _units_ns(tflops: float) -> float:
    """ns per score entry and head of 64 (4 * 64 flops) at ``tflops`` TFLOP/s."""
    return 4 * 64 / (tflops * 1e3)


def gpu_model(kernel_class: str, arch: str = DEFAULT_ARCH) -> CostModel:
    """The predicted :class:`CostModel` of ``kernel_class`` (a name in
    :data:`striped_sp.kernels.AUTO_ORDER`: ``fa4``, ``fa3``, ``cudnn``, ``fa2``, ``torch_flash``,
    ``efficient``) on GPU architecture ``arch`` (:data:`GPU_ARCHS`), named ``"<class>@<arch>"`` and
    labelled a prediction: per entry the published forward throughput (:data:`_PUBLISHED`), the
    causal forward's extra over half a square as ``causal_waste`` (at 8k rows), the backward over
    the forward as ``backward_factor``, tile fill as ``small_rows``; a launch per call; the ring
    link and the merge's memory traffic of the architecture.  A class without figures on ``arch``
    takes FA2's there (``ValueError`` for an unknown class or architecture)."""
    if arch not in GPU_ARCHS:
        raise ValueError(f"unknown GPU architecture {arch!r}: expected one of {sorted(GPU_ARCHS)}")
    if kernel_class not in _CLASS_FALLBACK and kernel_class != "fa2":
        raise ValueError(f"no GPU model for kernel class {kernel_class!r}: expected one of "
                         f"{sorted({'fa2', *_CLASS_FALLBACK})}")
    return _gpu_model(kernel_class, arch)


@functools.lru_cache(maxsize=None)
def _gpu_model(kernel_class: str, arch: str) -> CostModel:
    figures_arch = "H100" if arch in ("H800", "H200") else arch  # the same SMs and clocks
    figures = _PUBLISHED.get((kernel_class, figures_arch))
    if figures is None:
        figures = _PUBLISHED[(_CLASS_FALLBACK.get(kernel_class, "fa2"), figures_arch)]
    fwd, causal_fwd, bwd = figures
    link_gbps, hbm_tbps = GPU_ARCHS[arch]
    tile = 128.0 if kernel_class in ("fa3", "fa4", "cudnn") else 64.0
    return CostModel(f"{kernel_class}@{arch}", _units_ns(fwd), tile, (fwd / causal_fwd - 1) * 4096, _GPU_LAUNCH_NS / 64,
                     False, backward_factor=2.5 * fwd / bwd, transfer_ns_per_row=2 * 64 * 2 / link_gbps,
                     step_ns=_GPU_STEP_NS / 64, overlaps_transfer=True,
                     merge_ns_per_row=_MERGE_BYTES_PER_ROW / (hbm_tbps * 1e3), arch=arch)


@functools.lru_cache(maxsize=1)
def gpu_arch() -> str:
    """The architecture of this process's CUDA device (:data:`GPU_ARCHS`: by its name, else by its
    compute capability: 8.x A100, 9.x H100, 10.x B200), :data:`DEFAULT_ARCH` without one.  Cached:
    a process keeps its device."""
    if not torch.cuda.is_available():
        return DEFAULT_ARCH
    name = torch.cuda.get_device_name().upper()
    for arch in ("H800", "H200", "H100", "B200", "A100"):
        if arch in name:
            return arch
    major = torch.cuda.get_device_capability()[0]
    return {8: "A100", 9: "H100", 10: "B200"}.get(major, DEFAULT_ARCH)


@functools.lru_cache(maxsize=None)
def cuda_kernel_class(kernel_name: str) -> str:
    """The kernel class (:data:`striped_sp.kernels.AUTO_ORDER`) that runs ``kernel_name``'s packed /
    windowed calls on this process's CUDA device in bf16 (``"auto"``: the kernel ``backend="auto"``
    resolves there): what the plan decisions of that kernel price.  Without a device (dry runs on
    ``meta``) the kernel's own answer for a CUDA device, else FA2's.  Cached: a process keeps its
    device and packages."""
    from ..kernels import KERNELS, resolve_kernel

    cuda = torch.device("cuda")
    try:
        if kernel_name == "auto":
            kernel = resolve_kernel("auto", cuda, torch.bfloat16, varlen=True)
        else:
            kernel = KERNELS[kernel_name]
        cls = kernel.kernel_class(cuda, torch.bfloat16, None, True)
    except (KeyError, ValueError, RuntimeError, AssertionError):
        return "fa2"
    return cls if cls in _CLASS_FALLBACK or cls == "fa2" else "fa2"


#: every GPU model in the table too, by name (``"fa4@H100"``, ...); ``"flash_attn"``: the GPU
#: prediction of old, now FA2's on the default architecture
COST_MODELS.update({f"{cls}@{arch}": _gpu_model(cls, arch) for arch in GPU_ARCHS
                    for cls in ("fa4", "fa3", "cudnn", "fa2", "efficient")})
COST_MODELS["flash_attn"] = _gpu_model("fa2", DEFAULT_ARCH)


#: which table model prices each kernel (``"auto"``: what ``backend="auto"`` runs) on each device
#: type (read only); pairs not listed fall back by device type (:func:`model_for_kernel`)
_KERNEL_MODELS = {
    ("auto", "cpu"): "cpu",  # auto on the CPU: PyTorch's op for every float dtype
    ("torch", "cpu"): "cpu",
    ("math", "cpu"): "math_cpu",
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
    return gpu_model(cuda_kernel_class(kernel_name), gpu_arch())


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
