"""The Python steps of ``examples/gpu_check.sh`` (one GPU lease: <= 8 minutes on one H100/H200).

``python -m striped_sp.bench.gpu_check STEP [--out DIR] ...`` with STEP one of:

``env``        the device, torch, and the attention packages installed (flash-attn 2, flash-attn-4)
``exact``      every available backend on the device (PyTorch's flash / memory-efficient ops, cuDNN,
               flash-attn, FA4) runs the engine (all N ranks in one process:
               :func:`striped_sp.engine.local.simulate`) in bf16 on dense, packed (documents shorter than
               N) and windowed rows, GQA, against float64 attention on the device; max error per case,
               the peak memory
``gqa``        which of PyTorch's fused CUDA ops take GQA kv heads unexpanded (TorchKernel's probe)
``sims``       the ``bench sim`` command lines of the check (printed one per line; the script runs them):
               N = 8 on one GPU at ring-flash-attn's shape (8192 tokens per rank, 32 q / 8 kv heads x
               128, bf16), striped / zigzag / contiguous on each available backend, also on the packed
               web mix and with a window

``all``        the whole check as one command within the lease (``examples/gpu_check.sh`` runs it):
               ``env``; then ONE worker process (``worker``) runs, backend by backend, the exactness cases
               and the three sims in-process (FA4 compiles each flag set once, and keeps it on disk:
               ``FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1``); every record is appended to
               ``records.jsonl`` the moment it exists; a backend past its limit (:data:`TIMEOUTS`) is
               killed, recorded as a timeout of the case it was running, and a fresh worker goes on with
               the next backend; then the CUDA tests; the summary is printed last.  The limits add up to
               at most :data:`BUDGET_S` (:func:`budget`).
``worker``     what ``all`` runs in its worker process (not for direct use)

A CPU test runs every step at a tiny size (``--tiny``), ``all`` with a backend that fails and one
that hangs, so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import torch

__all__ = ["main", "exactness", "sim_commands", "environment", "run_all", "budget", "TIMEOUTS", "BUDGET_S"]

#: ring-flash-attn's published benchmark shape (its README: 8 GPUs, 8192 tokens per GPU, 32 q / 8 kv x 128)
RING_FLASH_SHAPE = ("--heads", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bfloat16",
                    "--world-sizes", "8", "--tokens-per-rank", "8192")
TINY_SHAPE = ("--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "float32", "--world-sizes", "2",
              "--tokens-per-rank", "16")
CUDA_BACKENDS = ("torch", "torch_cudnn", "flash_attn", "fa4")
#: ``all``'s limit per backend (seconds): its 7 exactness cases and 3 sims at ring-flash-attn's shape
#: (FA4's first calls compile each flag set, tens of seconds each: it gets the most)
TIMEOUTS = {"torch": 70, "torch_cudnn": 60, "flash_attn": 60, "fa4": 190}
#: ``all``'s limit for the CUDA tests (tests/gpu/test_cuda.py and the GQA probe)
TESTS_TIMEOUT = 60
#: the lease's 8 minutes: the limits of ``all`` add up to no more (start-up and the summary are seconds)
BUDGET_S = 480
RECORDS = "records.jsonl"
#: FA4's compile cache on disk (flash_attn/cute/cache_utils.py): a fresh worker reuses what an
#: earlier one compiled
FA4_CACHE_ENV = {"FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED": "1"}


def budget(timeouts: dict | None = None, tests: int = TESTS_TIMEOUT) -> int:
    """The seconds ``all`` may take at most: every backend's limit and the CUDA tests' limit."""
    return sum((TIMEOUTS if timeouts is None else timeouts).values()) + tests


def environment() -> dict:
    """What the device and the attention packages are."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    if torch.cuda.is_available():
        info["capability"] = ".".join(map(str, torch.cuda.get_device_capability()))
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("flash-attn", "flash-attn-4"):
        try:
            info[dist] = version(dist)
        except PackageNotFoundError:
            info[dist] = None
    return info


def _cases(n: int, per_rank: int) -> list[tuple[str, dict]]:
    seq = n * per_rank
    short = [0, 1, 3, 3 + n // 2, seq // 2, seq]  # documents shorter than N, and long ones
    return [("dense striped", dict(layout="striped")), ("dense zigzag", dict(layout="zigzag")),
            ("dense contiguous", dict(layout="contiguous")),
            ("packed striped:stripe=doc", dict(layout="striped:stripe=doc", cu_seqlens=short)),
            ("packed striped", dict(layout="striped", cu_seqlens=short)),
            ("window striped", dict(layout="striped", window_size=(per_rank + 3, 0))),
            ("packed+window contiguous", dict(layout="contiguous", cu_seqlens=short, window_size=(5, 0)))]


def _reference(q, k, v, do, causal, cu_seqlens, window):
    """float64 attention of the whole row (no engine code), and its gradients."""
    seq = q.size(1)
    pos = torch.arange(seq, device=q.device)
    rel = pos.unsqueeze(0) - pos.unsqueeze(1)
    vis = rel <= 0 if causal else torch.ones(seq, seq, dtype=torch.bool, device=q.device)
    if cu_seqlens is not None:
        doc = torch.searchsorted(torch.tensor(cu_seqlens[1:], device=q.device), pos, right=True)
        vis = vis & (doc.unsqueeze(0) == doc.unsqueeze(1))
    if window is not None:
        vis = vis & (rel >= -window[0])
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    g = q.size(2) // k.size(2)
    s = torch.einsum("bqhd,bkhd->bhqk", qr, kr.repeat_interleave(g, 2)) * q.size(-1) ** -0.5
    out = torch.einsum("bhqk,bkhd->bqhd", s.masked_fill(~vis, float("-inf")).softmax(-1), vr.repeat_interleave(g, 2))
    (out * do.double()).sum().backward()
    return out.detach(), qr.grad, kr.grad, vr.grad


def exactness(device, dtype=torch.bfloat16, backends=None, kernels: dict | None = None, n: int = 4,
              per_rank: int = 64, heads=(8, 2), head_dim: int = 64, tol: float = 3e-2,
              on_record=None, on_start=None) -> list[dict]:
    """Records ``{"backend", "case", "max_err", "ok"}``: the engine on each backend (``kernels``:
    name -> kernel object, used as given; else each of ``backends`` that runs on ``device``) against
    float64.  Errors: max |got - want| / max(1, max |want|) over out, dq, dk, dv.  ``on_start(case)``
    before each case and ``on_record(record)`` after it (``all`` writes them as they come)."""
    from ..engine.local import simulate
    from ..kernels import available_backends, resolve_kernel

    device = torch.device(device)
    if kernels is None:
        names = [b for b in (backends or CUDA_BACKENDS) if b in available_backends(device, dtype, head_dim)]
        kernels = {b: resolve_kernel(b, device, dtype, head_dim) for b in names}
    gen = torch.Generator(device=device).manual_seed(0)
    records = []
    for name, kernel in kernels.items():
        for case, args in _cases(n, per_rank):
            if "cu_seqlens" in args or "window_size" in args:
                if kernel.varlen_unavailable_reason() is not None:
                    continue
            if on_start is not None:
                on_start(case)
            seq = n * per_rank
            q, do = (torch.randn(1, seq, heads[0], head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
            k, v = (torch.randn(1, seq, heads[1], head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
            sim = simulate(q, k, v, n, do, kernel=kernel, **args)
            want = _reference(q, k, v, do, True, args.get("cu_seqlens"), args.get("window_size"))
            err = max(float((g.double() - w).abs().max()) / max(1.0, float(w.abs().max()))
                      for g, w in zip((sim.out, sim.dq, sim.dk, sim.dv), want))
            records.append({"backend": name, "case": case, "max_err": err, "ok": err < tol})
            if on_record is not None:
                on_record(records[-1])
    return records


def gqa_probe(device) -> list[str]:
    """TorchKernel's verdict per PyTorch CUDA op: are fewer kv heads taken as they are?"""
    from ..kernels import TorchKernel

    q = torch.empty(1, 32, 8, 128, device=device, dtype=torch.bfloat16)
    k = torch.empty(1, 8, 8, 128, device=device, dtype=torch.bfloat16)
    return [f"GQA probe, torch {torch.__version__}, {op} op, bf16, head_dim 128: "
            f"native={TorchKernel(op)._gqa_native(op, q, k)}" for op in ("flash", "efficient", "cudnn")]


def sim_commands(out: str, backends, tiny: bool = False, device: str = "cuda") -> list[list[str]]:
    """The ``striped-sp bench sim`` argument lists of the check: per backend dense (with the
    one-device reference: % of ideal), the packed web mix, a window of 4096."""
    shape = list(TINY_SHAPE if tiny else RING_FLASH_SHAPE)
    common = ["bench", "sim", "--device", device, "--reps", "1" if tiny else "3", "--no-progress", *shape,
              "--layouts", "striped,zigzag,contiguous"]
    window = "8" if tiny else "4096"
    cmds = []
    for b in backends:
        cmds.append([*common, "--backend", b, "--json", f"{out}/sim_{b}_dense.json"])
        cmds.append([*common, "--backend", b, "--docs", "lognormal:median=1024,sigma=1.2", "--no-reference",
                     "--json", f"{out}/sim_{b}_packed.json"])
        cmds.append([*common, "--backend", b, "--window", window, "--no-reference", "--json",
                     f"{out}/sim_{b}_window.json"])
    return cmds


class _Log:
    """``records.jsonl``: one JSON object a line, written and flushed the moment it exists."""

    def __init__(self, out: pathlib.Path):
        self.path = out / RECORDS

    def write(self, **record) -> None:
        record.setdefault("t", round(time.time(), 3))
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())


def read_records(out) -> list[dict]:
    path = pathlib.Path(out) / RECORDS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _worker(out: pathlib.Path, device, backends: list[str], tiny: bool) -> int:
    """Every backend's exactness cases and sims in this one process, each record as it exists;
    a backend that raises is recorded and the next one runs."""
    from .. import cli
    from ..kernels import resolve_kernel

    log = _Log(out)
    dtype = torch.float32 if tiny or device.type == "cpu" else torch.bfloat16
    size = dict(n=2, per_rank=12, heads=(4, 2), head_dim=16) if tiny else {}
    for name in backends:
        log.write(kind="backend", backend=name)
        try:
            kernel = resolve_kernel(name, device, dtype, size.get("head_dim", 64))
        except Exception as e:  # noqa: BLE001 - recorded, the next backend runs
            log.write(kind="done", backend=name, task="resolve", status="error", error=f"{type(e).__name__}: {e}")
            log.write(kind="backend_done", backend=name)
            continue
        tasks = [("exact", None)] + [(f"sim_{pathlib.Path(c[-1]).stem.rsplit('_', 1)[-1]}", c)
                                     for c in sim_commands(str(out), [name], tiny, device.type)]
        for task, cmd in tasks:
            t0 = time.time()
            try:
                if cmd is None:
                    exactness(device, dtype, kernels={name: kernel}, **size,
                              on_start=lambda case: log.write(kind="start", backend=name, task=f"exact {case}"),
                              on_record=lambda r: log.write(kind="exact", **r))
                    status, error = "ok", None
                else:
                    log.write(kind="start", backend=name, task=task)
                    rc = cli.main(cmd)
                    status, error = ("ok", None) if rc == 0 else ("error", f"exit status {rc}")
            except Exception as e:  # noqa: BLE001 - recorded, the next task runs
                status, error = "error", f"{type(e).__name__}: {e}"
            log.write(kind="done", backend=name, task=task, status=status, error=error,
                      seconds=round(time.time() - t0, 2), json=cmd[-1] if cmd else None)
        log.write(kind="backend_done", backend=name)
    return 0


def _kill(proc: subprocess.Popen) -> None:
    """The worker and whatever it started (its own session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_all(out, device: str, backends: list[str], timeouts: dict | None = None, tiny: bool = False,
            tests: list[str] | None = None, tests_timeout: int = TESTS_TIMEOUT, plugin: str | None = None,
            poll: float = 0.2) -> list[dict]:
    """``all``: see the module docstring.  ``tests``: the pytest arguments of the CUDA tests
    (``None``: none); ``plugin``: a module the worker imports first (the CPU test's doubles).
    Returns the records."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    log = _Log(out)
    timeouts = {**TIMEOUTS, **(timeouts or {})}
    info = environment()
    (out / "env.json").write_text(json.dumps(info, indent=1))
    log.write(kind="env", **info, budget_s=budget({b: timeouts.get(b, 60) for b in backends}, tests_timeout))
    env = {**os.environ, **FA4_CACHE_ENV, "PYTHONUNBUFFERED": "1"}
    root = str(pathlib.Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    pending = list(backends)
    while pending:
        cmd = [sys.executable, "-m", "striped_sp.bench.gpu_check", "worker", "--out", str(out), "--device", device,
               "--backends", ",".join(pending)] + (["--tiny"] if tiny else []) + (["--plugin", plugin] if plugin else [])
        seen = len(read_records(out))
        with open(out / "worker.log", "a") as wlog:
            proc = subprocess.Popen(cmd, stdout=wlog, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        current, since, task, done = None, None, None, set()
        while True:
            records = read_records(out)[seen:]
            for r in records:
                if r["kind"] == "backend":
                    current, since, task = r["backend"], r["t"], None
                elif r["kind"] == "start":
                    task = r["task"]
                elif r["kind"] == "backend_done":
                    done.add(r["backend"])
            seen += len(records)
            if proc.poll() is not None:
                break
            if current is not None and current not in done and time.time() - since > timeouts.get(current, 60):
                _kill(proc)
                log.write(kind="done", backend=current, task=task or "start", status="timeout",
                          limit_s=timeouts.get(current, 60))
                break
            time.sleep(poll)
        for r in read_records(out)[seen:]:
            if r["kind"] == "backend_done":
                done.add(r["backend"])
        stopped = proc.returncode != 0 and current is not None and current not in done
        if stopped and not any(r.get("status") == "timeout" and r.get("backend") == current
                               for r in read_records(out)):
            log.write(kind="done", backend=current, task=task or "start", status="crashed",
                      error=f"worker exit status {proc.returncode} (worker.log)")
        finished = done | ({current} if stopped else set())
        rest = [b for b in pending if b not in finished]
        if rest == pending:  # the worker died before any backend: do not loop
            for b in rest:
                log.write(kind="done", backend=b, task="start", status="crashed",
                          error=f"worker exit status {proc.returncode} (worker.log)")
            break
        pending = rest
    if tests:
        t0 = time.time()
        try:
            res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *tests],
                                 capture_output=True, text=True, timeout=tests_timeout, env=env, cwd=root)
            (out / "pytest.log").write_text(res.stdout + res.stderr)
            status = "ok" if res.returncode == 0 else "error"
            tail = (res.stdout.strip().splitlines() or [""])[-1]
        except subprocess.TimeoutExpired:
            status, tail = "timeout", f"over {tests_timeout} s"
        log.write(kind="done", backend="-", task="cuda tests", status=status, error=tail,
                  seconds=round(time.time() - t0, 2))
    return read_records(out)


def summary(records: list[dict]) -> str:
    """The check's outcome, one line per task and backend (printed last)."""
    lines = ["== summary: backend / task / status / seconds or max error"]
    for r in records:
        if r["kind"] == "exact":
            lines.append(f"{r['backend']:12s} exact {r['case']:28s} {'ok' if r['ok'] else 'FAIL'} "
                         f"max_err {r['max_err']:.2e}")
        elif r["kind"] == "done":
            extra = f" {r['seconds']} s" if r.get("seconds") is not None else ""
            extra += f" (limit {r['limit_s']} s)" if r.get("limit_s") else ""
            extra += f": {r['error']}" if r.get("error") else ""
            lines.append(f"{r['backend']:12s} {r['task']:34s} {r['status']}{extra}")
    bad = [r for r in records if (r["kind"] == "done" and r["status"] != "ok") or (r["kind"] == "exact" and not r["ok"])]
    lines.append(f"== {len(bad)} not ok" if bad else "== all ok")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m striped_sp.bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["env", "exact", "gqa", "sims", "all", "worker"])
    p.add_argument("--out", default="gpu_out", help="folder for the step's JSON")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny size (the CPU test of this script)")
    p.add_argument("--backends", default=None, help="all / worker: comma-separated backends (default: those that run)")
    p.add_argument("--timeouts", default="", help="all: NAME=SECONDS,... overriding TIMEOUTS")
    p.add_argument("--plugin", default=None, help="all / worker: a module imported first (tests register doubles)")
    p.add_argument("--no-tests", action="store_true", help="all: skip the CUDA tests")
    args = p.parse_args(argv)
    if args.plugin:
        import importlib

        importlib.import_module(args.plugin)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.device(args.device)
    if args.step == "env":
        info = environment()
        print(json.dumps(info))
        (out / "env.json").write_text(json.dumps(info, indent=1))
        return 0
    if args.step == "gqa":
        for line in gqa_probe(device):
            print(line)
        return 0
    if args.step == "worker":
        return _worker(out, device, args.backends.split(","), args.tiny)
    from ..kernels import available_backends

    dtype = torch.float32 if args.tiny or device.type == "cpu" else torch.bfloat16
    names = CUDA_BACKENDS if device.type == "cuda" else ("torch", "math")
    backends = [b for b in names if b in available_backends(device, dtype, 16 if args.tiny else 128)]
    if args.step == "all":
        (out / RECORDS).unlink(missing_ok=True)  # this run's records only
        chosen = args.backends.split(",") if args.backends else backends
        for b in [b for b in names if b not in backends and not args.backends]:
            from ..kernels import KERNELS

            _Log(out).write(kind="done", backend=b, task="available", status="skipped",
                            error=KERNELS[b].unavailable_reason(device, dtype, 16 if args.tiny else 128))
        timeouts = {k: float(v) for k, v in (kv.split("=") for kv in args.timeouts.split(",") if kv)}
        tests = None if args.no_tests or device.type != "cuda" else [
            "tests/gpu/test_cuda.py", "tests/unit/test_cuda_contracts.py::test_gqa_native_probe_on_gpu"]
        records = run_all(out, str(device), chosen, timeouts, args.tiny, tests, plugin=args.plugin)
        print(summary(records))
        return 0 if all(r["ok"] for r in records if r["kind"] == "exact") and not any(
            r["kind"] == "done" and r["status"] not in ("ok", "skipped") for r in records) else 1
    if args.step == "sims":
        for cmd in sim_commands(str(out), backends, args.tiny, device.type):
            print(" ".join(cmd))
        return 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    size = dict(n=2, per_rank=12, heads=(4, 2), head_dim=16) if args.tiny else {}
    records = exactness(device, dtype, backends, **size)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    for r in records:
        print(f"{r['backend']:12s} {r['case']:28s} max_err {r['max_err']:.2e} {'ok' if r['ok'] else 'FAIL'}")
    (out / "exact.json").write_text(json.dumps({"records": records, "peak_bytes": peak}, indent=1))
    return 0 if all(r["ok"] for r in records) else 1


if __name__ == "__main__":
    sys.exit(main())
