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

A CPU test runs every step at a tiny size (``--tiny``), so the script cannot rot.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

__all__ = ["main", "exactness", "sim_commands", "environment"]

#: ring-flash-attn's published benchmark shape (its README: 8 GPUs, 8192 tokens per GPU, 32 q / 8 kv x 128)
RING_FLASH_SHAPE = ("--heads", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bfloat16",
                    "--world-sizes", "8", "--tokens-per-rank", "8192")
TINY_SHAPE = ("--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--dtype", "float32", "--world-sizes", "2",
              "--tokens-per-rank", "16")
CUDA_BACKENDS = ("torch", "torch_cudnn", "flash_attn", "fa4")


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
              per_rank: int = 64, heads=(8, 2), head_dim: int = 64, tol: float = 3e-2) -> list[dict]:
    """Records ``{"backend", "case", "max_err", "ok"}``: the engine on each backend (``kernels``:
    name -> kernel object, used as given; else each of ``backends`` that runs on ``device``) against
    float64.  Errors: max |got - want| / max(1, max |want|) over out, dq, dk, dv."""
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
            seq = n * per_rank
            q, do = (torch.randn(1, seq, heads[0], head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
            k, v = (torch.randn(1, seq, heads[1], head_dim, generator=gen, device=device).to(dtype) for _ in range(2))
            sim = simulate(q, k, v, n, do, kernel=kernel, **args)
            want = _reference(q, k, v, do, True, args.get("cu_seqlens"), args.get("window_size"))
            err = max(float((g.double() - w).abs().max()) / max(1.0, float(w.abs().max()))
                      for g, w in zip((sim.out, sim.dq, sim.dk, sim.dv), want))
            records.append({"backend": name, "case": case, "max_err": err, "ok": err < tol})
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m striped_sp.bench.gpu_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["env", "exact", "gqa", "sims"])
    p.add_argument("--out", default="gpu_out", help="folder for the step's JSON")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="a tiny size (the CPU test of this script)")
    args = p.parse_args(argv)
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
    from ..kernels import available_backends

    dtype = torch.float32 if args.tiny or device.type == "cpu" else torch.bfloat16
    names = CUDA_BACKENDS if device.type == "cuda" else ("torch", "math")
    backends = [b for b in names if b in available_backends(device, dtype, 16 if args.tiny else 128)]
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
