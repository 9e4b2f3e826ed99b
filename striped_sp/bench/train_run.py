"""``striped-sp bench train``'s run (:mod:`striped_sp.bench.train` says what it measures): the
presets and :class:`TrainConfig`, the spawned ranks' training loop (:func:`_worker_body`: every
column's model and optimizer, interleaved timed rounds, the records of a row) and the parent's
checks and :func:`train`.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .common import init_rank, median, pick_dtype, progress, since, spawn_ranks, start_clocks, sync

__all__ = ["TrainConfig", "PRESETS", "PEERS", "AUTO", "train", "missing"]

#: model and row defaults for each --preset (``cpu``: the CPU measurement, 2 gloo ranks, fp32;
#: ``paper``: the paper's lengths with a ~1B model, for N GPUs)
PRESETS = {
    "cpu": dict(layers=2, hidden=256, ffn_hidden=1024, heads=4, kv_heads=2, head_dim=64, vocab=2048,
                seq_lens=(4096, 8192, 16384), packed_lens=(16384,), window_lens=(16384,), window=1024,
                rounds=4),
    "paper": dict(layers=16, hidden=2048, ffn_hidden=5632, heads=16, kv_heads=4, head_dim=128, vocab=32000,
                  seq_lens=(16384, 32768, 65536, 131072), packed_lens=(65536,), window_lens=(65536,),
                  window=4096, rounds=5),
}
PEERS = {"megatron": ("native",), "hf": ("ulysses",)}
AUTO = "striped:auto"


@dataclasses.dataclass
class TrainConfig:
    models: tuple = ("megatron", "hf")
    kinds: tuple = ("dense", "packed", "window")
    world_size: int = 2
    seq_lens: tuple = (4096, 8192, 16384)
    packed_lens: tuple = (16384,)
    window_lens: tuple = (16384,)
    docs: str = "lognormal:median=1024,sigma=1.2"
    window: int = 1024  # the window row: a query sees this many keys before it
    layouts: tuple = ("striped", AUTO, "zigzag", "contiguous")
    peers: tuple = ("native", "ulysses")
    layers: int = 2
    hidden: int = 256
    ffn_hidden: int = 1024
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    vocab: int = 2048
    batch: int = 1  # dense rows per step (packed rows: 1)
    dtype: str = "auto"
    device: str = "auto"
    warmup: int = 1
    rounds: int = 4
    seed: int = 1234
    init_std: float = 0.02  # weight init std (Megatron's init_method_std, HF's initializer_range)
    threads: int | None = None  # CPU threads per rank; default cores // N
    pin: bool = True
    profile: bool = False  # one more step per column under torch.profiler (ms by kind of op)
    memory: bool | None = None  # peak memory on the first step (None: CUDA only; the CPU count runs torch.profiler)
    progress: bool = True
    timeout_s: float = 1800.0
    hf_model: str = "llama"  # the hf path's model: llama (Mistral for the window row) or the hybrid lfm2

    def rows(self):
        """``(model, kind, seq_len)`` of every row, in the order they run."""
        lens = {"dense": self.seq_lens, "packed": self.packed_lens, "window": self.window_lens}
        return [(m, k, s) for m in self.models for k in self.kinds for s in lens[k]]

    def columns(self, model: str) -> list[str]:
        return list(self.layouts) + [p for p in self.peers if p in PEERS[model]]


# ---------------------------------------------------------------------------------------------
# worker
# ---------------------------------------------------------------------------------------------

def _paths(model: str):
    if model == "megatron":
        from . import train_megatron as mod
    else:
        from . import train_hf as mod
    return mod


def _resolve(cfg: TrainConfig, row, name: str) -> str | None:
    """The layout key of column ``name`` on ``row`` (``None``: a peer)."""
    import striped_sp

    if name == AUTO:
        from .train_megatron import resolve_auto

        return resolve_auto(cfg, row)
    if name in PEERS[row.model]:
        return None
    return striped_sp.get_layout(name).key


def _init(rank: int, cfg: TrainConfig, device_type: str, init_file: str):
    n = cfg.world_size
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("STRIPED_SP_TRAIN_PORT", "29533"))
    if device_type == "cpu":  # DeepSpeed reads these
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return init_rank(rank, n, device_type, init_file, cfg.timeout_s, cfg.threads, cfg.pin)


def _worker_body(rank, cfg: TrainConfig, device_type, init_file, results):
    import warnings

    import torch.distributed as dist

    from .memory import MemoryPeak
    from .train_data import RunnerSkip, make_row
    from .train_report import profiled_step

    warnings.filterwarnings("ignore")
    device = _init(rank, cfg, device_type, init_file)
    dtype = pick_dtype(cfg.dtype, device)
    memory = cfg.memory if cfg.memory is not None else device.type == "cuda"
    group = dist.group.WORLD
    ready = set()
    records, notes, profile = [], {}, []
    rows = cfg.rows()
    bar = progress(rows, total=len(rows), desc=f"train N={cfg.world_size}", enabled=cfg.progress and rank == 0)
    for model, kind, seq in bar:
        mod = _paths(model)
        if model not in ready:
            mod.setup(cfg, device)
            ready.add(model)
        row = make_row(model, kind, seq, cfg.warmup + cfg.rounds, cfg.batch, cfg.vocab, cfg.seed,
                       cfg.window, cfg.docs)
        key = (model, row.label, seq)
        runners, alias, layouts = {}, {}, {}
        for name in cfg.columns(model):
            layout = layouts[name] = _resolve(cfg, row, name)
            same = next((n for n, r in runners.items() if layout is not None and r.layout == layout), None)
            if same is not None:  # e.g. striped:auto that resolves to plain striped: one model
                alias[name] = same
                notes[(*key, name)] = f"= {same} ({layout})"
                continue
            try:
                runners[name] = mod.build_runner(cfg, row, name, layout, group, device, dtype)
            except RunnerSkip as e:
                notes[(*key, name)] = f"skipped: {e}"
        samples = {n: [] for n in runners}
        cpu = {n: [] for n in runners}  # the busiest rank's CPU time per step (a cross-check under load)
        losses = {n: [] for n in runners}
        peaks = {}
        order = list(runners)
        for i in range(cfg.warmup + cfg.rounds):
            shift = i % len(order) if order else 0
            for name in order[shift:] + order[:shift]:
                r = runners[name]
                r.activate()
                measure = i == 0 and memory
                tracker = MemoryPeak(device) if measure else None
                dist.barrier()
                sync(device)
                start = start_clocks()
                if tracker is not None:
                    with tracker:
                        loss = r.step(i)
                        sync(device)
                else:
                    loss = r.step(i)
                    sync(device)
                dt = since(start, device)
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                loss = loss.float().reshape(1).clone()
                if not getattr(r, "loss_is_global", False):
                    dist.all_reduce(loss)
                if measure:
                    peak = torch.tensor([float(r.param_bytes + tracker.peak)], device=device)
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                    peaks[name] = peak.item() / 2**20
                if i >= cfg.warmup:
                    samples[name].append(dt[0].item())
                    cpu[name].append(dt[1].item())
                    losses[name].append(loss.item())
        if cfg.profile:
            for name in order:
                runners[name].activate()
                profile.append({"model": model, "row": row.label, "seq_len": seq, "impl": name, "rank": rank,
                                **profiled_step(runners[name], cfg.warmup, device)})
        records += _row_records(cfg, row, samples, cpu, losses, peaks, alias, layouts)
        del runners
    results.put(("ok", rank, (records, {"|".join(map(str, k)): v for k, v in notes.items()}, profile)))
    dist.barrier()
    dist.destroy_process_group()


def _row_records(cfg, row, samples, cpu, losses, peaks, alias, layouts) -> list[dict]:
    import striped_sp

    meds = {n: median(ts) for n, ts in samples.items() if ts}
    cpu_meds = {n: median(ts) for n, ts in cpu.items() if ts}
    base = meds.get("contiguous")
    cpu_base = cpu_meds.get("contiguous")
    zig = meds.get("zigzag")
    ref = next(iter(losses.values()), [])
    tokens = row.seq_len * (cfg.batch if row.kind != "packed" else 1)
    out = []
    for name in cfg.columns(row.model):
        src = alias.get(name, name)
        m = meds.get(src)
        layout = layouts.get(name)
        pad = 0
        if row.kind == "packed" and layout is not None:
            pad = round(sum(striped_sp.pad_documents(torch.tensor(b), cfg.world_size, layout).padding_tokens
                            for _, b in row.rounds[cfg.warmup:]) / cfg.rounds)
        diff = None
        if losses.get(src) and ref:
            diff = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses[src], ref))
        out.append({"model": row.model, "hf_model": cfg.hf_model if row.model == "hf" else None, "row": row.label, "kind": row.kind, "seq_len": row.seq_len,
                    "impl": name, "layout": layout, "same_as": alias.get(name), "world_size": cfg.world_size,
                    "median_ms": None if m is None else m * 1e3,
                    "tokens_per_s": None if m is None else tokens / m,
                    "speedup_vs_contiguous": base / m if base and m else None,
                    "speedup_vs_zigzag": zig / m if zig and m else None,
                    "cpu_ms": None if src not in cpu_meds else cpu_meds[src] * 1e3,
                    "cpu_speedup_vs_contiguous": cpu_base / cpu_meds[src] if cpu_base and cpu_meds.get(src) else None,
                    "peak_mib": peaks.get(src), "losses": losses.get(src), "loss_rel_diff": diff,
                    "padding_tokens": pad, "documents": row.documents,
                    "samples_ms": [t * 1e3 for t in samples.get(src, [])],
                    "cpu_samples_ms": [t * 1e3 for t in cpu.get(src, [])]})
    return out


# ---------------------------------------------------------------------------------------------
# parent
# ---------------------------------------------------------------------------------------------

def _device_type(cfg: TrainConfig) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= cfg.world_size else "cpu"
    kind = torch.device(cfg.device).type
    if kind == "cuda" and torch.cuda.device_count() < cfg.world_size:
        raise ValueError(f"world_size={cfg.world_size} needs that many GPUs, found {torch.cuda.device_count()}")
    return kind


def _check(cfg: TrainConfig) -> None:
    import striped_sp

    from .docs import parse_docs

    if "contiguous" not in cfg.layouts:
        raise ValueError("bench train needs the 'contiguous' layout: speedups are relative to it")
    for name in cfg.layouts:
        if name != AUTO:
            striped_sp.get_layout(name)
    for m in cfg.models:
        if m not in PEERS:
            raise ValueError(f"model {m!r}: expected megatron or hf")
    if cfg.heads % cfg.kv_heads:
        raise ValueError(f"heads={cfg.heads} must be a multiple of kv_heads={cfg.kv_heads}")
    if "hf" in cfg.models:
        from .train_hf import hf_model_check

        hf_model_check(cfg)
    if "packed" in cfg.kinds:
        parse_docs(cfg.docs)
    if "window" in cfg.kinds and cfg.window < 1:
        raise ValueError(f"window={cfg.window}: the window row needs a window >= 1")
    for _, kind, seq in cfg.rows():
        for name in cfg.layouts:
            if name != AUTO and kind == "dense":
                striped_sp.get_layout(name).check_seq_len(seq, cfg.world_size)


#: what each model path imports, and the extra that installs it
_NEEDS = {"megatron": (("megatron.core", "megatron"),), "hf": (("transformers", "hf"), ("deepspeed", "deepspeed"))}


def missing(model: str) -> str | None:
    """Why ``model``'s path cannot run here (a package it needs is not installed), or ``None``."""
    import importlib.util

    for module, extra in _NEEDS[model]:
        if importlib.util.find_spec(module.split(".")[0]) is None or importlib.util.find_spec(module) is None:
            return f"{module} is not installed (pip install 'striped_sp[{extra}]')"
    return None


def train(cfg: TrainConfig):
    """Spawn the ranks and train; returns ``(records, notes, profile)``.

    ``records``: one per (row, column): ``model``, ``row``, ``kind``, ``seq_len``, ``impl`` (the column),
    ``layout`` (its key; ``None`` for a peer), ``median_ms``, ``tokens_per_s``, ``speedup_vs_contiguous``,
    ``speedup_vs_zigzag``, ``cpu_ms`` / ``cpu_speedup_vs_contiguous`` (the same from the busiest
    rank's process CPU time per step: time a rank spent descheduled by other jobs does not count,
    a wait that spins does), ``same_as`` (the column whose run this one is, when its layout resolved
    to that column's: ``striped:auto`` on dense rows), ``peak_mib`` (parameters + the first step's
    peak allocations, the largest rank), ``losses`` (per timed round, the global mean),
    ``loss_rel_diff``, ``padding_tokens``, ``samples_ms`` / ``cpu_samples_ms`` (every timed round);
    ``notes``: ``{(model, row, seq_len, impl): text}`` (skips, aliases); ``profile``: per (row, impl, rank)
    milliseconds by kind of op (``profile=True``).
    """
    _check(cfg)
    skipped = {m: missing(m) for m in cfg.models if missing(m)}
    if skipped:
        cfg = dataclasses.replace(cfg, models=tuple(m for m in cfg.models if m not in skipped))
        if not cfg.models:
            raise ValueError("bench train: no model path can run here: " + "; ".join(
                f"{m}: {why}" for m, why in skipped.items()))
    device_type = _device_type(cfg)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    got = spawn_ranks(_worker_body, (cfg, device_type), cfg.world_size, cfg.timeout_s, "bench train")
    records, notes, _ = got[0]
    notes = {tuple(k.split("|")): v for k, v in notes.items()}
    notes = {(m, r, int(s), i): v for (m, r, s, i), v in notes.items()}
    profile = [row for r in sorted(got) for row in got[r][2]]
    for m, why in skipped.items():
        notes[(m, "-", 0, "-")] = f"skipped: {why}"
    return records, notes, profile
