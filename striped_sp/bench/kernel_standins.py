"""Stand-ins for the attention kernels, to time what the engine does beside them: aten attention ops
that return shape-only outputs (:class:`ShapeOnlyAttention`) and PyTorch's CUDA branch of
:class:`~striped_sp.kernels.TorchKernel` on any tensors (:class:`CudaBranch`, and on CPU tensors
inside :func:`_cuda_branch_on_cpu`).
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings

import torch

from ..kernels import TorchKernel, torch_sdpa

__all__ = ["ShapeOnlyAttention", "shape_only_attention", "CudaBranch"]


def _meta_like(x):
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _key(x):
    if isinstance(x, torch.Tensor):
        return x.shape, x.stride(), x.dtype
    return tuple(x) if isinstance(x, list) else x


class ShapeOnlyAttention:
    """While open (``with``), the aten ops named in ``ops`` return uninitialised outputs of the
    right shapes, strides and dtypes on ``dispatch_key`` (from the op's meta kernel, once per
    signature) instead of computing: registered over the real kernels with ``torch.library``, removed
    on exit.  The ring's host work without the attention compute: ``seconds`` (on ``clock``) is the
    time spent inside the stand-ins, for the caller to subtract; what remains of a call is the
    dispatcher's, about a kernel launch."""

    def __init__(self, ops, dispatch_key: str = "CPU", clock=time.process_time):
        self.ops, self.dispatch_key, self.clock = tuple(ops), dispatch_key, clock
        self.seconds, self.calls = 0.0, 0
        self._lib = None

    def __enter__(self) -> "ShapeOnlyAttention":
        self._lib = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Overriding a previously registered kernel": that is the point
            for name in self.ops:
                self._lib.impl(name, functools.partial(self._call, getattr(torch.ops.aten, name), {}),
                               self.dispatch_key)
        return self

    def __exit__(self, *exc) -> None:
        self._lib._destroy()  # the registrations go, the real kernels are back
        self._lib = None

    def _call(self, op, cache: dict, *args, **kwargs):
        t0 = self.clock()
        key = (tuple(_key(a) for a in args), tuple((k, _key(v)) for k, v in kwargs.items()))
        shapes = cache.get(key)
        if shapes is None:
            res = op(*[_meta_like(a) for a in args], **{k: _meta_like(v) for k, v in kwargs.items()})
            res = res if isinstance(res, tuple) else (res,)
            shapes = cache[key] = [(r.shape, r.stride(), r.dtype) if isinstance(r, torch.Tensor) else r for r in res]
        device = args[0].device
        out = tuple(torch.empty_strided(s[0], s[1], dtype=s[2], device=device) if isinstance(s, tuple) else s
                    for s in shapes)
        self.calls += 1
        self.seconds += self.clock() - t0
        return out if len(out) > 1 else out[0]


def shape_only_attention(ops, dispatch_key: str = "CPU") -> ShapeOnlyAttention:
    """:class:`ShapeOnlyAttention` of ``ops`` (a context manager)."""
    return ShapeOnlyAttention(ops, dispatch_key)


class CudaBranch(TorchKernel):
    """:class:`~striped_sp.kernels.TorchKernel`'s CUDA branch wherever its tensors are: PyTorch's
    flash op (its choice for bf16 on an sm80+ GPU), native varlen programs.  On meta tensors (the
    dry run) as it is; on CPU tensors inside :func:`_cuda_branch_on_cpu`."""

    def _cuda_op_for(self, device, dtype, head_dim=None) -> str:
        return "flash"

    def native_varlen(self, device, dtype, head_dim=None) -> bool:
        return self.cuda_variant is None

    def unavailable_reason(self, device, dtype, head_dim=None):
        return None


@contextlib.contextmanager
def _cuda_branch_on_cpu():
    """TorchKernel takes its CUDA branch for CPU tensors too (its one seam, ``_uses_cpu_op``)."""
    seam = torch_sdpa._uses_cpu_op
    torch_sdpa._uses_cpu_op = lambda t: False
    try:
        yield
    finally:
        torch_sdpa._uses_cpu_op = seam
