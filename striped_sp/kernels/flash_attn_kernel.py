"""flash-attn 2 as a block kernel (``backend="flash_attn"``): dense calls and varlen calls.

Written against flash-attn's private ``flash_attn.flash_attn_interface`` functions, whose
parameters changed across 2.x releases (``window_size`` tuple before 2.6, separate
``window_size_left/right`` after; torch custom ops from 2.7); the varlen path needs 2.6 or newer
(earlier releases return a padded lse).  Imported lazily: flash-attn is an optional extra.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Callable

import torch

from .base import _HALF_DTYPES, Kernel, flash2_window, head_dims

__all__ = ["FlashAttnKernel"]


def _installed_version(module: str, dist_name: str) -> tuple[int, ...] | None:
    """(major, minor) of an installed package, or ``None`` when unknown."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001 - not installed, or a broken install (unavailable_reason says which)
        return None
    text = getattr(mod, "__version__", None)
    if text is None:
        try:
            from importlib.metadata import PackageNotFoundError, version

            text = version(dist_name)
        except (ImportError, PackageNotFoundError):
            return None
    if not text:
        return None
    parts = []
    for piece in str(text).split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            return None
        parts.append(int(digits))
    return tuple(parts)


def _call_with_supported_kwargs(fn: Callable, **kwargs):
    """Call ``fn`` with the keyword arguments its signature accepts (flash-attn's private
    functions gained and renamed parameters across 2.x releases)."""
    # From 2.7 on (with torch >= 2.4) they are torch.library custom ops whose __call__ takes
    # (*args, **kwargs): read the parameters of the wrapped function instead.
    params = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
    if "window_size_left" not in params and "window_size" in params:
        kwargs["window_size"] = (kwargs.pop("window_size_left", -1), kwargs.pop("window_size_right", -1))
    return fn(**{k: v for k, v in kwargs.items() if k in params})


def _rng_state(q: torch.Tensor) -> torch.Tensor:
    """The ``rng_state`` a backward call passes: int64 ``[2]`` (seed, offset) on ``q``'s device, the
    shape and dtype flash-attn's forward returns it in.  flash-attn 2.7.4's backward kernel reads
    its dropout state from ``params.rng_state`` whether or not it drops out (csrc
    ``flash_bwd_kernel.h``), so ``None`` (a null pointer) is not safe even at dropout 0; without
    dropout the values are never used.  The ring's backward runs long after the forward (whose
    results are the merged ``out``/``lse``), so a zero state stands in for the forward's."""
    return torch.zeros(2, dtype=torch.int64, device=q.device)


class FlashAttnKernel(Kernel):
    """flash-attn 2's forward/backward (``flash_attn.flash_attn_interface``), GQA native.

    Needs the ``flash`` extra (``pip install 'striped_sp[flash]'``) and a CUDA device.
    """

    name = "flash_attn"
    #: flash-attn 2 needs one head dim for q, k and v (Dao-AILab/flash-attention#914); FA3's
    #: ``hdim_v`` is another module: the ring pads v
    native_value_head_dim = False
    module_name = "flash_attn.flash_attn_interface"

    def __init__(self, deterministic: bool = False):
        #: flash-attn's deterministic backward (slower: no atomic adds into dq)
        self.deterministic = deterministic

    def _module(self):
        return importlib.import_module(self.module_name)

    def unavailable_reason(self, device, dtype, head_dim=None):
        try:
            self._module()
        except ImportError as e:
            if isinstance(e, ModuleNotFoundError) and (e.name is None or self.module_name.startswith(e.name)):
                return "flash-attn is not installed: pip install 'striped_sp[flash]'"
            return f"flash-attn is installed but importing {self.module_name} failed: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - a broken install must not break the other backends
            return (f"flash-attn is installed but importing {self.module_name} failed: {type(e).__name__}: {e} "
                    "(a broken install; see docs/troubleshooting.md)")
        if device.type != "cuda":
            return f"flash-attn runs on CUDA devices only, got device '{device}'"
        if dtype not in _HALF_DTYPES:
            return f"flash-attn needs float16 or bfloat16, got {dtype}"
        d, dv = head_dims(head_dim)
        for dim in {d, dv} - {None}:
            if dim % 8 != 0 or dim > 256:
                return f"flash-attn needs head_dim a multiple of 8 and at most 256, got {dim}"
        return None

    def deterministic_variant(self):
        return self if self.deterministic else _DETERMINISTIC.with_softcap(self.softcap)

    def softcap_unavailable_reason(self):
        # softcap= arrived in flash-attn 2.6.0; older builds would drop the keyword (see below)
        version = _installed_version("flash_attn", "flash-attn")
        if version is not None and version < (2, 6):
            return f"flash-attn {'.'.join(map(str, version))} has no softcap (flash-attn >= 2.6 has)"
        return None

    def kernel_class(self, device, dtype, head_dim=None, varlen=False):
        return "fa2"

    def causal_alignment(self, device, dtype, head_dim=None):
        version = _installed_version("flash_attn", "flash-attn")
        if version is None:
            return "unknown"
        return "top_left" if version < (2, 1) else "bottom_right"  # changed in 2.1

    def forward(self, q, k, v, causal, scale):
        res = _call_with_supported_kwargs(
            self._module()._flash_attn_forward,
            q=q, k=k, v=v, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=self.softcap, alibi_slopes=None,
            return_softmax=False,
        )
        # 2.6+: (out, lse, S_dmask, rng_state); earlier 2.x: (out, q, k, v, out_padded, lse, S_dmask, rng_state)
        out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])
        return out, lse[:, :, : q.size(1)].float().contiguous()

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _call_with_supported_kwargs(
            self._module()._flash_attn_backward,
            dout=dout.contiguous(), q=q, k=k, v=v, out=out, softmax_lse=lse.contiguous(),
            dq=dq, dk=dk, dv=dv, dropout_p=0.0, softmax_scale=scale, causal=causal,
            window_size_left=-1, window_size_right=-1, softcap=self.softcap, alibi_slopes=None,
            deterministic=self.deterministic, rng_state=_rng_state(q),
        )
        return dq, dk, dv

    def varlen_unavailable_reason(self):
        # before 2.6 the varlen lse came back padded, [num_seqs, h, max_seqlen_q]
        version = _installed_version("flash_attn", "flash-attn")
        if version is not None and version < (2, 6):
            return (f"flash-attn {'.'.join(map(str, version))} returns a padded varlen lse; "
                    "packed documents and windows need flash-attn >= 2.6 (or backend='torch')")
        return None

    def native_varlen(self, device, dtype, head_dim=None) -> bool:
        return True

    def varlen_forward_op(self, q, k, v, cu_q, cu_k, max_q, max_k, wl, wr, scale):
        wl, wr = flash2_window(wl, wr)
        res = _call_with_supported_kwargs(
            self._module()._flash_attn_varlen_forward,
            q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
            dropout_p=0.0, softmax_scale=scale, causal=wl < 0 and wr == 0, window_size_left=wl,
            window_size_right=wr, softcap=self.softcap, alibi_slopes=None, return_softmax=False,
        )
        # 2.6+: (out, lse [h, total_q], S_dmask, rng_state); earlier: lse at index 5
        return (res[0], res[1]) if len(res) == 4 else (res[0], res[5])

    def varlen_backward_op(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, wl, wr, scale):
        wl, wr = flash2_window(wl, wr)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        _call_with_supported_kwargs(
            self._module()._flash_attn_varlen_backward,
            dout=dout, q=q, k=k, v=v, out=out, softmax_lse=lse, dq=dq, dk=dk, dv=dv,
            cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, dropout_p=0.0,
            softmax_scale=scale, causal=wl < 0 and wr == 0, window_size_left=wl, window_size_right=wr,
            softcap=self.softcap, alibi_slopes=None, deterministic=self.deterministic, rng_state=_rng_state(q),
        )
        return dq, dk, dv


_DETERMINISTIC = FlashAttnKernel(deterministic=True)
