"""``bench sim --predict ARCH``: the ring's time on a GPU the cost model predicts, nothing run.

Every rank's plan is the engine's own (:func:`~striped_sp.plan.ring_plan.build_host_plan`, as
:class:`~striped_sp.engine.request.RingRequest` builds it); the kernel class's GPU model
(:func:`~striped_sp.plan.cost.gpu_model`, a prediction until calibrated) prices each rank's calls
of each ring step, its merge and the K/V transfer.  As in the timed sim, a round lasts as long as
its slowest rank or its transfer (overlapped), and the critical path is the sum of the rounds,
forward and backward.

Two baselines ("% of ideal"):

* ``efficiency``: the sim's, one device running the whole row (contiguous, ``N = 1``), over ``N``;
* ``of_ideal``: ring-flash-attention's (benchmark/benchmark_kvpacked_func.py and its README): ``N``
  times one GPU running ``flash_attn`` on one rank's tokens as a row of its own (its documents a
  ``1/N`` share of the global ones), since a ring of ``N`` does ``N`` times that work per rank.

With ``--docs`` / ``--window`` the row is the one ``bench sim`` times for them (:func:`.docs.workload`,
seeded; zigzag's documents padded to a multiple of ``2N``) and each layout's plans are the ones its
masked simulation runs (:func:`.sim_masked.masked_request`); the striped default's per-batch search
then chooses by the model the engine would use on that GPU (:func:`search_model`), not this
machine's.  ``of_ideal`` is left empty there (its baseline needs every document a multiple of ``N``).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..engine.request import RingRequest
from ..plan import cost
from ..plan.cost import CostModel, gpu_model
from ..plan.layouts import get_layout
from ..plan.masks import make_mask
from ..plan.ring_plan import _predicted_ms, build_host_plan
from .docs import workload
from .sim_masked import masked_request

__all__ = ["PredictShape", "KERNEL_CLASSES", "kernel_class_of", "search_model", "row_hosts", "predict_ring",
           "predict_layouts", "ring_flash_attn_setup", "fwd_bwd_speedup", "RING_FLASH_ATTN_H800",
           "RING_FLASH_ATTN_VARLEN_ROWS"]

#: ``--backend`` names and the kernel class whose model prices them in predict mode (a class name
#: itself is accepted too: ``fa3``, ``cudnn``, ...)
KERNEL_CLASSES = {"flash_attn": "fa2", "torch": "torch_flash", "torch_cudnn": "cudnn", "fa4": "fa4"}


def kernel_class_of(backend: str, arch: str, varlen: bool) -> str:
    """The kernel class ``backend`` runs as on ``arch`` in predict mode (``auto``: :data:`AUTO_ORDER`'s
    first that runs there: FA4 on H100/H800/H200 and B200, packed and windowed calls too (FA4's SM90
    varlen backward from 4.0.0b5), else FA2; cuDNN's packed calls run on the memory-efficient op)."""
    if backend == "auto":
        return "fa2" if arch == "A100" else "fa4"
    cls = KERNEL_CLASSES.get(backend, backend)
    return "efficient" if cls == "cudnn" and varlen else cls


@dataclasses.dataclass(frozen=True)
class PredictShape:
    """The shape of the predicted ring: ``batch`` rows of ``heads`` query / ``kv_heads`` key-value
    heads of ``head_dim``, elements of ``elem_bytes`` (K/V on the ring), dK/dV sent in
    ``grad_bytes`` (the ring's fp32 accumulators by default)."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    batch: int = 1
    elem_bytes: int = 2
    grad_bytes: int = 4

    @property
    def units(self) -> float:
        """The model's unit count: heads of 64 per row, times the rows."""
        return self.batch * self.heads * self.head_dim / 64


def search_model(arch: str) -> CostModel:
    """The model the engine's plan choices use on ``arch`` (:func:`~striped_sp.plan.cost.default_model`
    there: the class of the kernel ``backend="auto"`` runs for packed calls, whatever the backend)."""
    return gpu_model(kernel_class_of("auto", arch, True), arch)


@contextlib.contextmanager
def _searching_on(arch: str):
    """Plans built inside choose as on ``arch`` (the striped default's search, by :func:`search_model`
    adopted for this process's device type); the model adopted before is back after."""
    before = cost._ADOPTED[0]
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    cost.use_model(dataclasses.replace(search_model(arch), kernel="auto", device_type=device_type))
    try:
        yield
    finally:
        cost.use_model(before)


def _request_hosts(request: RingRequest, world_size: int, local_len: int) -> list:
    """Every rank's host plan of ``request`` (causal or not, its documents and window), as
    :func:`~striped_sp.engine.local.local_plans` builds them: the request's mask rule, the engine's planner."""
    mask = request._mask(local_len, world_size)
    return [build_host_plan(request.layout, mask, request.causal, world_size, r, local_len) for r in range(world_size)]


def _hosts(layout: str, world_size: int, local_len: int, bounds, window: int = 0) -> list:
    """Every rank's host plan of ``layout`` on a row of ``bounds`` (``None``: one document; given, the
    masked plans even for one document: a varlen row, as ring-flash-attention's benchmark runs it)."""
    win = (window, 0) if window else None
    if bounds is None:
        return _request_hosts(RingRequest(None, layout=layout, window_size=win), world_size, local_len)
    lay = get_layout(layout)
    mask = make_mask(world_size * local_len, world_size, lay, [int(b) for b in bounds], win)
    return [build_host_plan(lay, mask, True, world_size, r, local_len) for r in range(world_size)]


def row_hosts(layout: str, world_size: int, tokens_per_rank: int, docs: str | None = None, window: int = 0,
              seed: int = 0):
    """``(workload, hosts)``: the row ``bench sim`` runs for ``layout`` with these ``--docs`` /
    ``--window`` (:func:`.docs.workload`) and every rank's host plan of the request its masked
    simulation builds for it (:func:`.sim_masked.masked_request`)."""
    work = workload(layout, world_size, tokens_per_rank, docs, window, seed)
    return work, _request_hosts(masked_request(layout, work, docs, window), world_size, work.local_len)


def _rows(host, kv_share: float) -> list[float]:
    """Query rows each step's calls merge (per batch row), a gathered row counted twice (its copy
    and its merge through the index), key/value rows gathered counted at ``kv_share`` (kv heads per
    query head): the rows the model's ``merge_ns_per_row`` prices."""
    n = host.local_len
    return [sum(c.q_len(n) * (1 if isinstance(c.q, slice) else 2)
                + (0 if isinstance(c.kv, slice) else c.kv_len(n) * kv_share) for c in step) for step in host.calls]


def predict_ring(model: CostModel, layout: str, world_size: int, local_len: int, shape: PredictShape,
                 bounds=None) -> dict:
    """Predicted seconds ``{"forward", "backward", "fwd+bwd"}`` of ``layout``'s ring of
    ``world_size`` ranks holding ``local_len`` tokens each (``bounds``: the row's global document
    boundaries, ``None``: one document), causal, on ``model``."""
    return _ring_seconds(model, _hosts(layout, world_size, local_len, bounds), shape)


def _ring_seconds(model: CostModel, hosts: list, shape: PredictShape) -> dict:
    """Predicted seconds ``{"forward", "backward", "fwd+bwd"}`` of the ring of these ranks' plans."""
    world_size = len(hosts)
    units = shape.units
    steps = max(h.steps for h in hosts)
    per_rank = []
    for h in hosts:
        compute = [ms * 1e6 * units for ms in _predicted_ms(h, model)]
        merge = [r * model.merge_ns_per_row * units for r in _rows(h, shape.kv_heads / shape.heads)]
        carried = [0 if t + 1 >= h.steps else (h.local_len if h.shared is None else h.shared[(h.rank - t) % world_size])
                   for t in range(h.steps)]
        per_rank.append((compute, merge, carried))
    link = 2 * 64 * 2 / model.transfer_ns_per_row  # bytes per ns (the model's row: K and V, head of 64, bf16)
    kv = shape.batch * shape.kv_heads * shape.head_dim * 2  # K and V elements per row
    fwd = bwd = 0.0
    for t in range(steps):
        def slowest(fn):
            return max(fn(*r, t) if t < len(r[0]) else 0.0 for r in per_rank)

        c_f = slowest(lambda c, m, _, t: c[t] + m[t])
        c_b = slowest(lambda c, m, _, t: c[t] * model.backward_factor + 2 * m[t])
        rows = slowest(lambda c, m, k, t: k[t])
        x_f = rows * kv * shape.elem_bytes / link
        x_b = rows * kv * (shape.elem_bytes + shape.grad_bytes) / link
        join = max if model.overlaps_transfer else (lambda a, b: a + b)
        fwd += join(c_f, x_f) + model.step_ns * units / 2
        bwd += join(c_b, x_b) + model.step_ns * units / 2
    return {"forward": fwd * 1e-9, "backward": bwd * 1e-9, "fwd+bwd": (fwd + bwd) * 1e-9}


def _one_device(model: CostModel, seq_len: int, shape: PredictShape, bounds=None, window: int = 0) -> dict:
    """One device, no ring: causal attention over a row of ``seq_len`` tokens (``bounds``: its
    documents; ``window``: the left window)."""
    (host,) = _hosts("contiguous", 1, seq_len, bounds, window)
    fwd = sum(_predicted_ms(host, model)) * 1e-3 * shape.units
    bwd = fwd * model.backward_factor
    return {"forward": fwd, "backward": bwd, "fwd+bwd": fwd + bwd}


def predict_layouts(arch: str, backend: str, layouts, world_size: int, local_len: int,
                    shape: PredictShape = PredictShape(), bounds=None, model: CostModel | None = None,
                    docs: str | None = None, window: int = 0, seed: int = 0) -> list[dict]:
    """Records ``{"layout", "world_size", "tokens_per_rank", "docs", "window", "documents",
    "padding_tokens", "pass", "kernel_class", "model", "critical_path_ms", "efficiency", "of_ideal",
    "plan"}`` (the two baselines of this module's docstring; ``plan``: the layout's decision for the
    row, ``None`` for a fixed one) of each layout's predicted ring on ``arch`` with ``backend``'s
    kernel class (``model``: price with this one instead); the plans chosen as on ``arch``
    (:func:`search_model`).  ``bounds``: global document boundaries, each document's length a
    multiple of ``2 * world_size`` (so every rank's share is ``1/N`` of it, as ring-flash-attention's
    varlen benchmark has it).  ``docs`` / ``window``: ``bench sim``'s ``--docs`` / ``--window`` (the
    row and plans it runs, :func:`row_hosts`; not with ``bounds``; ``of_ideal`` ``None``)."""
    masked = docs is not None or bool(window)
    if masked and bounds is not None:
        raise ValueError("predict_layouts: give bounds (ring-flash-attention's rows) or docs / window, not both")
    cls = kernel_class_of(backend, arch, bounds is not None or masked)
    model = model or gpu_model(cls, arch)
    seq = world_size * local_len
    if bounds is not None:
        bounds = [int(b) for b in bounds]
        if bounds[0] != 0 or bounds[-1] != seq or any(b % world_size for b in bounds):
            raise ValueError(f"bounds {bounds}: expected 0 ... {seq}, each a multiple of N = {world_size}")
    records = []
    with _searching_on(arch):
        if masked:  # the whole unpadded row on one device, as the masked simulation's reference
            base = workload("contiguous", world_size, local_len, docs, window, seed)
            whole = _one_device(model, seq, shape, list(base.mask.bounds) if docs else None, window)
            local = None
        else:
            whole = _one_device(model, seq, shape, bounds)
            local = _one_device(model, local_len, shape, None if bounds is None else [b // world_size for b in bounds])
        for layout in layouts:
            if masked:
                work, hosts = row_hosts(layout, world_size, local_len, docs, window, seed)
                row = {"documents": len(work.mask.bounds) - 1, "padding_tokens": work.padding_tokens}
            else:
                hosts = _hosts(layout, world_size, local_len, bounds)
                row = {"documents": 1 if bounds is None else len(bounds) - 1, "padding_tokens": 0}
            crit = _ring_seconds(model, hosts, shape)
            plan = hosts[0].decision
            for p in ("forward", "backward", "fwd+bwd"):
                records.append({"layout": layout, "world_size": world_size, "tokens_per_rank": local_len, "docs": docs,
                                "window": window or 0, **row, "pass": p, "kernel_class": cls, "model": model.label,
                                "critical_path_ms": crit[p] * 1e3, "efficiency": whole[p] / world_size / crit[p],
                                "of_ideal": None if local is None else local[p] * world_size / crit[p], "plan": plan})
    return records


#: ring-flash-attention's published % of ideal, 8xH800, fwd+bwd, 8192 tokens per GPU, 32 q / 8 kv
#: heads x 128, bf16, flash-attn 2 (its README): layout -> percent; "varlen zigzag": zigzag over the
#: four packed rows of benchmark_varlen_kvpacked_func.py (per-GPU boundaries, times N globally)
RING_FLASH_ATTN_H800 = {"contiguous": 53.9, "zigzag": 90.2, "striped": 82.9, "varlen zigzag": 75.9}
#: the per-GPU document boundaries its varlen benchmark cycles through (one iteration each)
RING_FLASH_ATTN_VARLEN_ROWS = ((0, 8192), (0, 256, 7648, 8192), (0, 4096, 8192), (0, 3104, 6304, 7904, 8064, 8192))


def ring_flash_attn_setup(arch: str = "H800", backend: str = "flash_attn", model: CostModel | None = None,
                          world_size: int = 8, local_len: int = 8192) -> dict:
    """Percent of ideal, fwd+bwd, of the four layouts of :data:`RING_FLASH_ATTN_H800` predicted at
    ring-flash-attention's setup (their baseline: ``of_ideal``).  The varlen row: the mean time over
    its four packed rows, as their iterations cycle through them (iterations per second of the ring
    over ``N`` times those of one GPU's varlen flash_attn)."""
    out = {}
    for rec in predict_layouts(arch, backend, ("contiguous", "zigzag", "striped"), world_size, local_len,
                               model=model):
        if rec["pass"] == "fwd+bwd":
            out[rec["layout"]] = 100 * rec["of_ideal"]
    ring = ideal = 0.0
    for local_bounds in RING_FLASH_ATTN_VARLEN_ROWS:
        bounds = [b * world_size for b in local_bounds]
        (rec,) = [r for r in predict_layouts(arch, backend, ("zigzag",), world_size, local_len, bounds=bounds,
                                             model=model) if r["pass"] == "fwd+bwd"]
        ring += rec["critical_path_ms"]
        ideal += rec["critical_path_ms"] * rec["of_ideal"]
    out["varlen zigzag"] = 100 * ideal / ring
    return out


def fwd_bwd_speedup(arch: str, faster: str, slower: str = "fa2", tokens: int = 8192, shape=PredictShape()) -> float:
    """The model's fwd+bwd time of ``slower`` over ``faster`` on one causal call of ``tokens`` on
    ``arch`` (kernel classes): how much faster its model says ``faster`` is."""
    t = {cls: _one_device(gpu_model(cls, arch), tokens, shape)["fwd+bwd"] for cls in (faster, slower)}
    return t[slower] / t[faster]


def run_cli(args) -> int:
    """``striped-sp bench sim --predict ARCH``: the predicted rings of ``args`` (layouts, world
    sizes, tokens per rank or sequence lengths, heads; the row of ``--docs`` / ``--window``),
    printed as a table, and ring-flash-attention's setup against its published figures.  Options
    this mode cannot honour are refused by name."""
    from .report import format_table, write_json

    for flag, value, why in (("--global-every", args.global_every, "it prices one layer's ring, not blocks of layers"),
                             ("--link-gbps", args.link_gbps, "the GPU model's own link prices the transfers"),
                             ("--plot", args.plot, "it writes no plot")):
        if value:
            raise SystemExit(f"striped-sp bench sim --predict: {flag} is not taken in predict mode ({why}): "
                             "run without it, or without --predict")
    masked = args.docs is not None or bool(args.window)
    if masked and args.seq_lens:
        raise SystemExit("striped-sp bench sim: with --docs/--window give --tokens-per-rank, not --seq-lens")
    if args.docs is not None and args.batch != 1:
        raise SystemExit(f"striped-sp bench sim --predict: --batch {args.batch} with --docs: a packed row is "
                         "one row (batch 1, the engine's cu_seqlens convention)")
    points = [(n, t) for n in args.world_sizes for t in (args.tokens_per_rank or [4096])]
    if args.seq_lens:
        bad = [(n, s) for n in args.world_sizes for s in args.seq_lens if s % n]
        if bad:
            n, seq = bad[0]
            raise SystemExit(f"striped-sp bench sim --predict: --seq-lens {seq} is not a multiple of N = {n}")
        points = [(n, s // n) for n in args.world_sizes for s in args.seq_lens]
    shape = PredictShape(heads=args.heads, kv_heads=args.kv_heads or args.heads, head_dim=args.head_dim,
                         batch=args.batch)
    recs = [r for n, t in points for r in predict_layouts(args.predict, args.backend, args.layouts, n, t, shape,
                                                          docs=args.docs, window=args.window)]
    print(f"sim --predict {args.predict}: nothing run; each rank's plan priced by the GPU cost model "
          f"{recs[0]['model'] if recs else ''}, chosen as on {args.predict} (by {search_model(args.predict).label}); "
          f"documents {args.docs or 'one per row'}, window {args.window or 'none'}\n"
          "efficiency = (one device, whole row) / N / critical path; of ideal = N x (one device, one rank's "
          "tokens) / critical path (ring-flash-attention's baseline; one document per row only)\n")
    cols = [("layout", "layout"), ("world_size", "N"), ("tokens_per_rank", "tokens/rank")]
    if args.docs is not None:
        cols += [("documents", "docs"), ("padding_tokens", "padding")]
    cols += [("pass", "pass"), ("kernel_class", "kernel"), ("critical_path_ms", "critical ms"),
             ("efficiency", "efficiency")] + ([] if masked else [("of_ideal", "of ideal")])
    print(format_table(recs, cols))
    plans = [r for r in recs if r["pass"] == "fwd+bwd" and r["plan"]]
    if plans:
        print()
    for r in plans:
        print(f"  {r['layout']} N={r['world_size']} tokens/rank={r['tokens_per_rank']}: {r['plan']}")
    check = ring_flash_attn_setup(args.predict)
    print("\nring-flash-attention's setup (8 GPUs, 8192 tokens each, 32 q / 8 kv heads x 128, bf16, fwd+bwd, FA2), "
          f"% of ideal predicted on {args.predict} against its 8xH800 figures:")
    for lay, pct in check.items():
        print(f"  {lay:14s} {pct:5.1f}  (published {RING_FLASH_ATTN_H800[lay]:.1f}, "
              f"{pct - RING_FLASH_ATTN_H800[lay]:+.1f})")
    if args.json:
        write_json(args.json, recs)
    return 0
