"""The measurements of ``striped-sp bench overhead`` (:mod:`striped_sp.bench.overhead` says what and
how): its configuration, the two paths (cpu; cuda on the GPU or as a dry run), rank 0 of N on PyTorch's
fake process group, the per-batch plan times and, per layer after the first, the counts and host time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from ..engine.autograd import RingAttention
from ..engine.plans import PLANS, plan_for
from ..engine.request import RingRequest
from ..engine.step import strict_block_mode
from ..engine.transport import TorchTransport, ring_timeout
from ..kernels import KERNELS, TorchKernel, accumulator_dtype
from ..plan import search
from ..plan.ring_plan import compile_plan
from .common import clock_for, median, sync
from .docs import workload
from .host_work import HostWork
from .kernel_standins import CudaBranch, ShapeOnlyAttention, _cuda_branch_on_cpu

__all__ = ["OverheadConfig", "measure", "ROWS", "DEFAULT_LAYOUTS", "WEB_MIX", "PATH_OPS"]

ROWS = ("dense", "packed", "window", "packed-window")
WEB_MIX = "lognormal:median=1024,sigma=1.2"
DEFAULT_LAYOUTS = ("contiguous", "zigzag", "striped", "striped:stripe=doc", "striped:place=auto",
                   "striped:stripe=512")
#: the attention ops each path calls (the ones :func:`shape_only_attention` replaces)
PATH_OPS = {
    "cpu": ("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"),
    "cuda": ("_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_flash_attention_backward"),
}


@dataclasses.dataclass
class OverheadConfig:
    layouts: tuple = DEFAULT_LAYOUTS
    points: tuple = ((8, 131072),)  # (N, tokens of the row)
    rows: tuple = ROWS
    paths: tuple = ("cpu", "cuda")
    device: str = "auto"  # the cuda path: "meta" (dry run), "cuda" (the GPU), "auto": cuda when present
    docs: str = WEB_MIX
    window: int = 4096
    heads: int = 1
    head_dim: int = 8
    reps: int = 3
    progress: bool = True


@contextlib.contextmanager
def _fake_world(size: int, device_types):
    """PyTorch's fake process group of ``size`` ranks, this process rank 0: collectives and
    transfers return at once (received buffers stay as allocated)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise ValueError("bench overhead runs rank 0 on PyTorch's fake process group: run it in a process "
                         "without a process group")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(",".join(f"{t}:fake" for t in device_types), store=FakeStore(), rank=0, world_size=size)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def _env(name: str, value: str):
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


@dataclasses.dataclass
class _Path:
    """Where a path runs: its kernel, tensor device and dtype, the ops it makes shape-only, and
    whether counts come from another device (``count_device``: meta for the dry run)."""

    name: str
    kernel: TorchKernel
    device: torch.device
    dtype: torch.dtype
    stub: tuple  # attention ops made shape-only (empty: the real kernels run)
    count_device: torch.device | None = None  # counts on this device instead (the dry run's meta)
    label: str = ""

    def context(self) -> tuple[contextlib.ExitStack, ShapeOnlyAttention | None]:
        """The context the path runs in, and its shape-only attention ops (``None``: the real ones)."""
        stack = contextlib.ExitStack()
        stub = None
        if self.stub:
            stub = stack.enter_context(ShapeOnlyAttention(self.stub, self.device.type.upper(),
                                                          clock_for(self.device, 1)))
        if self.name == "cuda" and self.device.type == "cpu":
            stack.enter_context(_cuda_branch_on_cpu())
        return stack, stub


def _paths(cfg: OverheadConfig) -> list[_Path]:
    device = cfg.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "meta"
    if device not in ("meta", "cuda"):
        raise ValueError(f"--device {cfg.device!r}: expected auto, meta or cuda (the cuda path's tensors)")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    out = []
    for name in cfg.paths:
        if name == "cpu":
            out.append(_Path("cpu", KERNELS["torch"], torch.device("cpu"), torch.float32, PATH_OPS["cpu"],
                             label="cpu"))
        elif device == "cuda":
            out.append(_Path("cuda", KERNELS["torch"], torch.device("cuda"), torch.bfloat16, (), label="cuda"))
        else:
            out.append(_Path("cuda", CudaBranch(), torch.device("cpu"), torch.bfloat16, PATH_OPS["cuda"],
                             count_device=torch.device("meta"), label="cuda (dry run)"))
    return out


def _request(layout: str, row: str, work, cfg: OverheadConfig) -> RingRequest:
    return RingRequest(None, layout=layout, cu_seqlens=list(work.mask.bounds) if row.startswith("packed") else None,
                       window_size=(cfg.window, 0) if row.endswith("window") else None)


def _clear_plans() -> None:
    """Every planner cache emptied: the next plan is a new batch's."""
    PLANS.clear()
    search._search.cache_clear()
    search._placed_runs.cache_clear()


class _Layer:
    """One rank's attention layer of one configuration on one device: ``run()`` is forward +
    backward as a layer runs it (the plan fetched from the plan cache)."""

    def __init__(self, request: RingRequest, path: _Path, device: torch.device, n: int, local: int,
                 cfg: OverheadConfig, group):
        self.request, self.kernel, self.n, self.local = request, path.kernel, n, local
        dtype, d = path.dtype, cfg.head_dim
        self.device, self.dtype, self.d = device, dtype, d
        self.mask = request._mask(local, n)
        self.strict = strict_block_mode(self.kernel, device, dtype, d, applies=(
            request.layout.strict_block and request.causal and self.mask is None and not request.hierarchical))
        self.scale = d ** -0.5
        self.heads = cfg.heads
        self.comm = accumulator_dtype(dtype)
        self.transport = TorchTransport(group, ring_timeout())
        shape = (1, local, cfg.heads, d)
        self.q, self.k, self.v = (torch.zeros(shape, dtype=dtype, device=device, requires_grad=True) for _ in range(3))
        self.dout = torch.zeros(shape, dtype=dtype, device=device)

    def plan(self):
        return plan_for(self.request.layout, self.mask, self.request.causal, self.n, 0, self.local, kernel=self.kernel,
                        scale=self.scale, comm_dtype=self.comm, strict_block=self.strict, device=self.device,
                        dtype=self.dtype, head_dim=self.d, batch=1, heads=self.heads)

    def run(self, counter: HostWork | None = None):
        if counter is not None:
            counter.phase = "forward"
        plan = self.plan()
        out = RingAttention.apply(self.q, self.k, self.v, plan, self.transport)
        if counter is not None:
            counter.phase = "backward"
        torch.autograd.grad(out, (self.q, self.k, self.v), self.dout)
        return plan


def _plan_times(request: RingRequest, seq: int, n: int, path: _Path, cfg: OverheadConfig) -> tuple[float, float]:
    """Median seconds of rank 0's per-batch plan: ``(prepare, compile)``, planner caches emptied."""
    device = path.count_device or path.device
    clock = clock_for(path.device, 1)
    prep, comp = [], []
    for rep in range(cfg.reps + 1):  # the first run warms up (imports, the cost model), not counted
        _clear_plans()
        t0 = clock()
        host = request.prepare(seq, world_size=n, rank=0)
        t1 = clock()
        compile_plan(host, kernel=path.kernel, scale=cfg.head_dim ** -0.5, comm_dtype=accumulator_dtype(path.dtype),
                     device=device, dtype=path.dtype, head_dim=cfg.head_dim, batch=1, heads=cfg.heads)
        sync(device)
        t2 = clock()
        if rep:
            prep.append(t1 - t0)
            comp.append(t2 - t1)
    return median(prep), median(comp)


def _window_groups(plan) -> list[int]:
    """Per step, the window classes of its calls (1 per step for a dense plan)."""
    if not plan.masked:
        return [1] * plan.steps
    out = []
    for step in plan.calls:
        keys = [c.segments.wl * (1 << 32) + (c.segments.wr + 1) for c in step]
        out.append(int(torch.unique(torch.cat(keys)).numel()) if keys else 0)
    return out


def _layer_counts(request, path: _Path, n: int, local: int, cfg: OverheadConfig, group) -> dict:
    """The counts of the layer after the first (and the first's copies), on the counting device."""
    device = path.count_device or path.device
    ctx = contextlib.ExitStack() if path.count_device is not None else path.context()[0]
    with ctx:
        layer = _Layer(request, path, device, n, local, cfg, group)
        PLANS.clear()
        with HostWork() as first:
            plan = layer.run(first)
        with HostWork() as later:
            layer.run(later)
        sync(device)
    launches = [plan.launches(t) for t in range(plan.steps)]
    groups = _window_groups(plan)
    per_group = max((a / g for a, g in zip(launches, groups) if g), default=0.0)
    per_step = max(launches, default=0)
    kernels = sum(later.kernels.values())
    return {"steps": plan.steps, "masked": plan.masked, "ops": later.total, "kernel_calls": kernels,
            "forward_kernel_calls": later.kernels["forward"], "other_ops": later.total - kernels,
            "comm_ops": later.comm, "views": later.views, "h2d_copies": later.copies,
            "syncs": sum(later.syncs.values()), "sync_ops": dict(later.syncs),
            "data_dependent_ops": later.data_dependent,
            "first_layer_h2d_copies": first.copies, "first_layer_syncs": sum(first.syncs.values()),
            "planned_forward_launches": sum(launches), "launches_per_step_group": per_group,
            "launches_per_step": per_step,
            "gathered_keys_per_step": sum(plan.gathered_keys(t) for t in range(plan.steps)) / plan.steps / local,
            "top_ops": [(k, c) for k, c in later.ops.most_common(6) if k.startswith("aten.")][:5]}


def _layer_time(request, path: _Path, n: int, local: int, cfg: OverheadConfig, group, profile: bool) -> dict:
    """Median host milliseconds of a layer after the first (forward + backward) on the path's device,
    less the time inside shape-only attention ops (``attention_stub_ms``: what was subtracted)."""
    stack, stub = path.context()
    with stack:
        layer = _Layer(request, path, path.device, n, local, cfg, group)
        PLANS.clear()
        layer.run()  # the batch's first layer: compiles the plan
        sync(path.device)
        clock, samples = clock_for(path.device, 1), []
        for _ in range(cfg.reps):
            inside = stub.seconds if stub is not None else 0.0
            t0 = clock()
            layer.run()
            t1 = clock()  # before the device finishes: host time
            stubbed = (stub.seconds if stub is not None else 0.0) - inside
            samples.append((t1 - t0 - stubbed, stubbed))
            sync(path.device)
        host, stubbed = sorted(samples)[(len(samples) - 1) // 2]  # the median (the lower one of an even count)
        out = {"host_ms": 1e3 * host, "attention_stub_ms": 1e3 * stubbed}
        if profile:
            out["profile"] = _profile(layer.run)
    return out


def _profile(fn, top: int = 12) -> list[tuple[str, float, int]]:
    """The functions of one call of ``fn`` with the most cumulative time: ``(where, ms, calls)``."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, func), (_, calls, _, cum, _) in stats.stats.items():
        if "striped_sp" in file:
            rows.append((f"{file.split('striped_sp/')[-1]}:{line}({func})", 1e3 * cum, calls))
    return sorted(rows, key=lambda r: -r[1])[:top]


def _config(layout, n, tokens, row, cfg, paths, group, profile) -> list[dict]:
    docs = cfg.docs if row.startswith("packed") else None
    window = cfg.window if row.endswith("window") else None
    work = workload(layout, n, tokens // n, docs, window)
    request = _request(layout, row, work, cfg)
    local, seq = work.local_len, work.mask.seq_len
    recs = []
    for path in paths:
        prep, comp = _plan_times(request, seq, n, path, cfg)
        rec = {"layout": layout, "world_size": n, "tokens": tokens, "seq_len": seq,
               "padding_tokens": work.padding_tokens, "row": row, "docs": docs, "window": window or 0,
               "path": path.label, "device": str(path.device),
               "count_device": str(path.count_device or path.device), "documents": len(work.mask.bounds) - 1,
               "prepare_ms": 1e3 * prep, "compile_ms": 1e3 * comp, "plan_ms": 1e3 * (prep + comp)}
        rec.update(_layer_counts(request, path, n, local, cfg, group))
        rec.update(_layer_time(request, path, n, local, cfg, group, profile))
        recs.append(rec)
    _clear_plans()
    return recs


def measure(cfg: OverheadConfig, profile: bool = False) -> list[dict]:
    """JSON records, one per (point, row, layout, path): ``plan_ms`` (``prepare_ms`` +
    ``compile_ms``), the layer's counts after the first (``ops``, ``kernel_calls``,
    ``forward_kernel_calls``, ``other_ops``, ``views``, ``h2d_copies``, ``syncs``), the first layer's
    ``first_layer_h2d_copies`` / ``first_layer_syncs``, ``steps``, ``gathered_keys_per_step`` (key
    rows gathered by index per forward step, in local blocks), ``launches_per_step_group`` (the
    most attention calls of a forward step per window class of its calls) and ``host_ms``."""
    from .common import progress

    paths = _paths(cfg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    types = sorted({"cpu", *(p.device.type for p in paths), *(p.count_device.type for p in paths if p.count_device)})
    todo = [(n, t, row, lay) for n, t in cfg.points for row in cfg.rows for lay in cfg.layouts]
    recs = []
    try:
        with _fake_world(max(n for n, _ in cfg.points), types) as dist, _env("STRIPED_SP_CHECK_RANKS", "0"):
            groups = {}
            for n, tokens, row, lay in progress(todo, total=len(todo), desc="overhead", enabled=cfg.progress):
                if n not in groups:
                    groups[n] = dist.new_group(list(range(n)))
                recs += _config(lay, n, tokens, row, cfg, paths, groups[n], profile)
    finally:
        torch.set_num_threads(threads)
    return recs
