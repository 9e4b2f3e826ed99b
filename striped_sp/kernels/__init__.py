"""Block attention kernels behind one small interface: the registry of the backends.

The interface (:class:`~striped_sp.kernels.base.Kernel`, documented in :mod:`striped_sp.kernels.base`)
lives in ``base``; every backend module imports only ``base`` and this registry imports the
backends (no import circle):

* :mod:`.math_ref`: ``math``, the matmul reference;
* :mod:`.torch_sdpa`: ``torch`` / ``torch_cudnn``, PyTorch's fused SDPA ops;
* :mod:`.flash_attn_kernel`: ``flash_attn``, flash-attn 2 (imported lazily).
"""

from __future__ import annotations

import torch

from .base import _FLOAT_DTYPES, _HALF_DTYPES, Kernel, _expand_kv, _group_sum, accumulator_dtype
from .flash_attn_kernel import FlashAttnKernel
from .math_ref import MathKernel
from .torch_sdpa import GQA_NATIVE_ENV, TorchKernel, gqa_probe_enabled

__all__ = ["Kernel", "KERNELS", "BACKENDS", "MathKernel", "TorchKernel", "FlashAttnKernel", "accumulator_dtype",
           "available_backends", "resolve_kernel", "gqa_probe_enabled", "GQA_NATIVE_ENV"]

KERNELS: dict[str, Kernel] = {
    k.name: k for k in (TorchKernel(), TorchKernel("cudnn"), FlashAttnKernel(), MathKernel())
}
BACKENDS = ("auto", *KERNELS)


def available_backends(device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> list[str]:
    """Names of the kernels that run on ``device`` with ``dtype`` (and ``head_dim``)."""
    return [n for n, k in KERNELS.items() if k.unavailable_reason(torch.device(device), dtype, head_dim) is None]


_DETERMINISTIC_FLASH_ATTN = FlashAttnKernel(deterministic=True)


def _deterministic_reason(name: str, device: torch.device) -> str | None:
    """Why kernel ``name`` has no deterministic backward on ``device`` (``None``: it has one).
    PyTorch's fused CUDA attention backward ops add into dq atomically."""
    if device.type == "cuda" and name in ("torch", "torch_cudnn"):
        return (f"backend {name!r} (PyTorch's fused CUDA attention ops) has no deterministic backward: "
                "use backend 'flash_attn' (flash-attn's deterministic mode) or 'math'")
    return None


def resolve_kernel(backend: str, device: torch.device, dtype: torch.dtype, head_dim: int | None = None,
                   deterministic: bool = False) -> Kernel:
    """The kernel for ``backend`` on ``device``/``dtype``/``head_dim``; ``ValueError`` when unknown or unusable.

    ``auto`` picks flash-attn on CUDA when importable for fp16/bf16, else PyTorch's fused ops,
    else the math reference.  ``deterministic``: bitwise-reproducible backward passes (the ring's
    own order is fixed; on CUDA this needs flash-attn's deterministic mode or the math kernel).
    """
    device = torch.device(device)
    if backend == "auto":
        order = ("flash_attn", "torch", "math") if device.type == "cuda" else ("torch", "math")
        for name in order:
            if deterministic and _deterministic_reason(name, device) is not None:
                continue
            if KERNELS[name].unavailable_reason(device, dtype, head_dim) is None:
                return _DETERMINISTIC_FLASH_ATTN if deterministic and name == "flash_attn" else KERNELS[name]
        raise ValueError(f"no attention backend runs on device '{device}' with dtype {dtype}"
                         + (" and a deterministic backward" if deterministic else ""))
    if backend not in KERNELS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {list(BACKENDS)}")
    kernel = KERNELS[backend]
    reason = kernel.unavailable_reason(device, dtype, head_dim)
    if reason is not None:
        raise ValueError(f"backend {backend!r} is not available: {reason}")
    if deterministic:
        reason = _deterministic_reason(backend, device)
        if reason is not None:
            raise ValueError(f"deterministic=True: {reason}")
        if backend == "flash_attn":
            return _DETERMINISTIC_FLASH_ATTN
    return kernel
