"""Block attention kernels behind one small interface: the registry of the backends.

The interface (:class:`~striped_sp.kernels.base.Kernel`, documented in :mod:`striped_sp.kernels.base`)
lives in ``base``; every backend module imports only ``base`` and this registry imports the
backends (no import circle):

* :mod:`.math_ref`: ``math``, the matmul reference;
* :mod:`.torch_sdpa`: ``torch`` / ``torch_cudnn``, PyTorch's fused SDPA ops;
* :mod:`.flash_attn_kernel`: ``flash_attn``, flash-attn 2 (imported lazily);
* :mod:`.fa4_kernel`: ``fa4``, FlashAttention-4 (imported lazily).

A new backend is one module and one :func:`register` line below: ``resolve_kernel`` asks the
kernel itself whether it runs (``unavailable_reason``), how it is deterministic
(``deterministic_reason`` / ``deterministic_variant``) and which class of kernel ``auto`` ranks it
as (``kernel_class``, ordered by :data:`AUTO_ORDER`).
"""

from __future__ import annotations

import logging
import math
import numbers

import torch

from .base import _FLOAT_DTYPES, _HALF_DTYPES, Kernel, _expand_kv, _group_sum, accumulator_dtype, head_dims
from .fa4_kernel import FA4Kernel
from .flash_attn_kernel import FlashAttnKernel
from .math_ref import MathKernel
from .torch_sdpa import GQA_NATIVE_ENV, TorchKernel, gqa_probe_enabled

__all__ = ["Kernel", "KERNELS", "BACKENDS", "MathKernel", "TorchKernel", "FlashAttnKernel", "FA4Kernel",
           "accumulator_dtype", "available_backends", "resolve_kernel", "register", "AUTO_ORDER",
           "gqa_probe_enabled", "GQA_NATIVE_ENV", "softcap_backends", "check_softcap"]

_LOG = logging.getLogger(__name__)

#: the classes of kernel ``backend="auto"`` picks from, fastest first (:meth:`Kernel.kernel_class`):
#: FlashAttention-4 (SM90/SM100), FlashAttention-3 (torch's registry, SM90), cuDNN (dense calls),
#: flash-attn 2 (the package, then PyTorch's vendored copy, whose varlen op expands kv heads), the
#: memory-efficient op; on the CPU PyTorch's CPU flash op, then the matmul reference
AUTO_ORDER = ("fa4", "fa3", "cudnn", "fa2", "torch_flash", "efficient", "cpu_flash", "math")

KERNELS: dict[str, Kernel] = {}


def register(kernel: Kernel) -> Kernel:
    """Add ``kernel`` to :data:`KERNELS` under its ``name`` (the ``backend=`` string); the order of
    registration breaks ties between kernels of one class under ``auto``."""
    KERNELS[kernel.name] = kernel
    return kernel


register(TorchKernel())
register(TorchKernel("cudnn"))
register(FlashAttnKernel())
register(FA4Kernel())
register(MathKernel())
BACKENDS = ("auto", *KERNELS)


def available_backends(device: torch.device, dtype: torch.dtype, head_dim=None, gqa: bool | None = None) -> list[str]:
    """Names of the kernels that run on ``device`` with ``dtype`` (and ``head_dim``: an int or
    ``(d, dv)``; ``gqa``: whether kv heads are fewer than query heads, ``None``: unknown, maybe)."""
    return [n for n, k in KERNELS.items() if _reason(k, torch.device(device), dtype, head_dim, gqa) is None]


def _reason(kernel: Kernel, device, dtype, head_dim, gqa: bool | None = None) -> str | None:
    """``kernel.unavailable_reason`` for the head dims it will be called with: ``(d, dv)`` where it
    takes v's head dim natively, else the one dim the ring pads both to (their max); then, unless
    the calls are known not to be GQA (``gqa=False``), ``kernel.gqa_unavailable_reason``."""
    d, dv = head_dims(head_dim)
    if d is not None and d != dv:
        head_dim = (d, dv) if kernel.native_value_head_dim else max(d, dv)
    why = kernel.unavailable_reason(device, dtype, head_dim)
    if why is None and gqa is not False:
        why = kernel.gqa_unavailable_reason(device, dtype, head_dim)
    return why


def check_softcap(softcap) -> float:
    """``softcap`` checked: ``None`` or 0 = off (0.0), else a positive finite float (an int is taken
    as its float); ``ValueError`` naming the value and the rule otherwise."""
    if softcap is None:
        return 0.0
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        raise ValueError(f"softcap={softcap!r} must be None, 0 (off) or a positive finite float (the logit cap c: "
                         f"every score s becomes c * tanh(s / c)), got {type(softcap).__name__}")
    value = float(softcap)
    if value == 0.0:
        return 0.0
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"softcap={softcap!r} must be None, 0 (off) or a positive finite float (the logit cap c: "
                         "every score s becomes c * tanh(s / c))")
    return value


def _deterministic_reason(name: str, device: torch.device) -> str | None:
    """Why kernel ``name`` has no deterministic backward on ``device`` (``None``: it has one)."""
    return KERNELS[name].deterministic_reason(torch.device(device))


_DETERMINISTIC_FLASH_ATTN = KERNELS["flash_attn"].deterministic_variant()


def _class_rank(kernel: Kernel, device, dtype, head_dim, varlen: bool | None) -> int:
    cls = kernel.kernel_class(device, dtype, head_dim, varlen is not False)
    return AUTO_ORDER.index(cls) if cls in AUTO_ORDER else len(AUTO_ORDER)


def resolve_kernel(backend: str, device: torch.device, dtype: torch.dtype, head_dim=None,
                   deterministic: bool = False, varlen: bool | None = None, gqa: bool | None = None,
                   softcap: float = 0.0) -> Kernel:
    """The kernel for ``backend`` on ``device``/``dtype``/``head_dim`` (an int, or ``(d, dv)`` for
    multi-latent attention); ``ValueError`` when unknown or unusable.

    ``auto`` picks, among the kernels that run, the fastest class (:data:`AUTO_ORDER`): on CUDA
    FA4 (SM90/SM100), FA3 (torch's registry on SM90), cuDNN for dense calls, flash-attn 2, the
    memory-efficient op; on the CPU PyTorch's op, else the math reference.  ``varlen``: whether
    the calls include packed documents or windows (``True``: kernels that cannot run them are passed
    over; ``False``: dense calls only, where cuDNN ranks above flash-attn 2; ``None``, unknown:
    every kernel is ranked by its class for packed calls, where cuDNN's run on the
    memory-efficient op).  ``gqa``: whether the kv heads are fewer than the query heads (``None``,
    unknown: a kernel with GQA rules of its own, FA4's SM90 MLA shapes, is judged as if they were).
    ``softcap`` (a checked positive float; 0 = off): logit soft-capping, which only kernels whose
    :meth:`~Kernel.softcap_unavailable_reason` is ``None`` apply (``auto`` passes the others over;
    a named one that cannot is a ``ValueError`` naming those that can); the kernel returned is
    :meth:`Kernel.with_softcap` of the choice.  On CUDA the choice and why are logged once.  ``deterministic``: bitwise-reproducible
    backward passes (the ring's own order is fixed; each kernel says whether and how).
    """
    device = torch.device(device)
    if backend == "auto":
        ranked = []
        passed = []
        for i, (name, kernel) in enumerate(KERNELS.items()):
            why = _reason(kernel, device, dtype, head_dim, gqa)
            if why is None and deterministic:
                why = kernel.deterministic_reason(device)
            if why is None and varlen is True:
                why = kernel.varlen_unavailable_reason()
            if why is None and softcap:
                why = kernel.softcap_unavailable_reason()
            if why is None:
                why = kernel.auto_reason(device, dtype, head_dim)
            if why is not None:
                passed.append(f"{name}: {why}")
                continue
            ranked.append((_class_rank(kernel, device, dtype, head_dim, varlen), i, kernel))
        if not ranked:
            raise ValueError(f"no attention backend runs on device '{device}' with dtype {dtype}"
                             + (" and a deterministic backward" if deterministic else "")
                             + (f" and softcap={softcap!r} (kernels that can soft-cap: {softcap_backends()}; "
                                f"passed over: {'; '.join(passed)})" if softcap else ""))
        _, _, kernel = min(ranked, key=lambda r: r[:2])
        if device.type == "cuda":
            _say_choice(kernel, device, dtype, head_dim, varlen, passed)
        return (kernel.deterministic_variant() if deterministic else kernel).with_softcap(softcap)
    if backend not in KERNELS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {list(BACKENDS)}")
    kernel = KERNELS[backend]
    reason = _reason(kernel, device, dtype, head_dim, gqa)
    if reason is not None:
        raise ValueError(f"backend {backend!r} is not available: {reason}")
    if softcap and kernel.softcap_unavailable_reason() is not None:
        raise ValueError(f"softcap={softcap!r}: backend {backend!r} cannot soft-cap logits "
                         f"({kernel.softcap_unavailable_reason()}); kernels that can: {softcap_backends()} "
                         "(backend='auto' picks one that runs here)")
    if deterministic:
        reason = kernel.deterministic_reason(device)
        if reason is not None:
            raise ValueError(f"deterministic=True: {reason}")
        kernel = kernel.deterministic_variant()
    return kernel.with_softcap(softcap)


def softcap_backends() -> list[str]:
    """Names of the kernels that apply logit soft-capping (wherever they run)."""
    return [n for n, k in KERNELS.items() if k.softcap_unavailable_reason() is None]


_SAID: set = set()  # the auto choices already logged: one line per choice and process, not per call


def _say_choice(kernel, device, dtype, head_dim, varlen, passed) -> None:
    cls = kernel.kernel_class(device, dtype, head_dim, varlen is not False)
    line = (f"striped_sp backend 'auto' on {device.type} ({dtype}, head_dim {head_dim}"
            f"{', packed/windowed' if varlen else ''}): {kernel.name!r} ({cls}, the fastest class that runs"
            + (f"; passed over: {'; '.join(passed)})" if passed else ")"))
    if line not in _SAID:
        _SAID.add(line)
        _LOG.info(line)
