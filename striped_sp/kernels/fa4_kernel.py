"""FlashAttention-4 as a block kernel (``backend="fa4"``): dense and varlen calls, GQA and MLA native.

Written against the private functions of ``flash_attn.cute.interface`` (the CuTe-DSL package,
``pip install --pre flash-attn-4``; SM90 and SM100, no build step), called directly rather than
through torch's registry (``activate_flash_attention_impl("FA4")`` unpacks two results and swaps
the kernels of the whole process).  What the calls rely on, read in the upstream source
(Dao-AILab/flash-attention ``flash_attn/cute/interface.py``):

* ``_flash_attn_fwd(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=,
  softmax_scale=, causal=, window_size_left=, window_size_right=, return_lse=)``: ``q``
  ``[b, s, h, d]`` (varlen ``[T, h, d]``), ``k`` with ``kv_heads`` dividing ``h`` (GQA native),
  ``v`` with its own head dim ``dv``; returns ``out`` ``[.., h, dv]`` and lse fp32 ``[b, h, s]``
  (varlen ``[h, T]``) first, then 0-3 more values depending on the release: taken by position.
  Causal masks and windows are bottom-right aligned; ``None`` is an open window side, and a
  causal call is ``causal=True`` (the right side set to 0).  A row that sees no key: lse ``-inf``,
  output 0.
* ``_flash_attn_bwd(q, k, v, out, dout, lse, softmax_scale=, causal=, window_size_left=,
  window_size_right=, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, max_seqlen_k=,
  deterministic=)`` -> ``(dq, dk, dv)`` first (kv heads as given, not expanded).

What each architecture runs, read in the releases 4.0.0b5 to 4.0.0b27 (the newest stored; the
interface and ``flash_bwd_sm90.py``), for the calls the ring makes (:data:`SUPPORT`):

* SM100 (10.x): forward and backward, dense and varlen, causal and windowed, GQA, deterministic;
  head dims ``(d, dv)`` both multiples of 8 up to 128, or ``(192, 128)``, or ``(256, 256)``.
* SM90 (9.x): the same calls, varlen and windowed backward included (upstream's SM90 varlen,
  deterministic and windowed backward landed before 4.0.0b5); head dims 8-256, multiples of 8,
  ``d != dv`` allowed (MLA's ``(192, 128)``) except in a GQA call's backward (``flash_bwd_sm90``
  asserts ``head_dim == head_dim_v`` when ``qhead_per_kvhead > 1``); a deterministic GQA backward
  from 4.0.0b12 (before it, dK/dV of a kv head shared by several query heads were summed with
  atomics).

The signatures are checked once, by parameter name; a release without one of them is refused
with its version and :data:`SUPPORTED`.  Imported lazily: ``pip install 'striped_sp[fa4]'``.
"""

from __future__ import annotations

import importlib
import inspect
import re

import torch

from .base import _HALF_DTYPES, Kernel, head_dims

__all__ = ["FA4Kernel", "SUPPORTED", "SUPPORT", "MODULE", "head_dim_reason", "gqa_head_dim_reason", "import_reason", "is_local",
           "no_local_hd256"]

MODULE = "flash_attn.cute.interface"
DIST = "flash-attn-4"
#: the releases whose interface this kernel was written against (the deterministic backward from
#: 4.0.0b5; results read by position, so 2, 4 or 5 of them)
SUPPORTED = ">=4.0.0b5,<4.1"
_FWD_PARAMS = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "softmax_scale",
               "causal", "window_size_left", "window_size_right", "return_lse")
_BWD_PARAMS = ("q", "k", "v", "out", "dout", "lse", "softmax_scale", "causal", "window_size_left",
               "window_size_right", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "deterministic")


def installed_version() -> str:
    """The installed flash-attn-4's version string (``"unknown"`` when it has no metadata)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version(DIST)
    except (ImportError, PackageNotFoundError):
        return "unknown"


def import_reason() -> str | None:
    """Why ``flash_attn.cute.interface`` cannot be imported (``None``: it imports).  Safe against
    any exception: the import pulls in cutlass, quack and tvm-ffi, and a broken install raises
    what it likes (a flash-attn 2 build over FA4's namespace: ``AttributeError: ThrMma``); that
    must cost only FA4, never ``available_backends`` or ``auto`` for the other backends."""
    try:
        importlib.import_module(MODULE)
    except ModuleNotFoundError as e:
        if e.name is None or MODULE.startswith(e.name):  # flash_attn, flash_attn.cute or the interface itself
            return "flash-attn-4 is not installed: pip install 'striped_sp[fa4]'"
        return (f"flash-attn-4 {installed_version()} is installed but importing {MODULE} failed: "
                f"ModuleNotFoundError: {e} (a dependency is missing: pip install 'striped_sp[fa4]')")
    except Exception as e:  # noqa: BLE001 - anything a broken install raises
        return (f"flash-attn-4 {installed_version()} is installed but importing {MODULE} failed: "
                f"{type(e).__name__}: {e} (a broken install: another flash_attn package, e.g. flash-attn 2, "
                "over FA4's, or mismatched nvidia-cutlass-dsl / quack-kernels; see docs/troubleshooting.md)")
    return None


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device`` (``None`` for any other device).  The one device
    predicate of this module: tests patch it to run the CUDA branch on CPU tensors."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability(device)


#: what FA4 runs of the ring's calls, per architecture (read in the upstream source, 4.0.0b5 to
#: 4.0.0b27): pass -> (varlen, windows, GQA, deterministic); head dims in :func:`head_dim_reason`,
#: GQA with MLA head dims in :func:`gqa_head_dim_reason`, the deterministic GQA backward on SM90 from
#: :data:`SM90_DETERMINISTIC_GQA`
SUPPORT = {
    (9, "forward"): dict(varlen=True, window=True, gqa=True),
    (9, "backward"): dict(varlen=True, window=True, gqa=True, deterministic=True),
    (10, "forward"): dict(varlen=True, window=True, gqa=True),
    (10, "backward"): dict(varlen=True, window=True, gqa=True, deterministic=True),
}
#: the first release whose SM90 GQA backward is deterministic (upstream's semaphores on dK/dV)
SM90_DETERMINISTIC_GQA = "4.0.0b12"


def _release(text: str) -> tuple | None:
    """``"4.0.0b12"`` -> ``(4, 0, 0, 12)``, in PEP 440's order: dev and alpha builds before every
    beta (-1), release candidates after them, a final release last; ``None`` when unreadable
    (``"unknown"``: no metadata)."""
    m = re.match(r"^(\d+)\.(\d+)\.(\d+)(?:(b|rc|a|\.?dev)(\d*))?", text)
    if m is None:
        return None
    major, minor, patch, kind, num = m.groups()
    step = {None: float("inf"), "b": int(num or 0), "rc": 1e9}.get(kind, -1)
    return int(major), int(minor), int(patch), step


def head_dim_reason(major: int, d: int | None, dv: int | None) -> str | None:
    """FA4's head dim rules per architecture (``None``: the pair runs): SM90 both 8-256, multiples
    of 8 (``d != dv`` too, but see :func:`gqa_head_dim_reason`); SM100 both 8-128 (multiples of 8),
    or ``(192, 128)`` (DeepSeek's MLA), or ``(256, 256)``."""
    if d is None:
        return None
    dv = d if dv is None else dv
    if major == 9:
        if d % 8 or dv % 8 or not (8 <= d <= 256 and 8 <= dv <= 256):
            return f"FA4 on SM90 needs head dims (d, dv) multiples of 8 in 8-256, got ({d}, {dv})"
        return None
    if (d, dv) in ((192, 128), (256, 256)) or (8 <= d <= 128 and 8 <= dv <= 128 and d % 8 == 0 and dv % 8 == 0):
        return None
    return f"FA4 on SM100 needs head dims (d, dv) both multiples of 8 up to 128, or (192, 128), or (256, 256); got ({d}, {dv})"


def is_local(causal: bool, wl: int | None, wr: int | None) -> bool:
    """Whether FA4 runs a call as local (windowed) attention: upstream's
    ``_resolve_causal_local_window`` (``causal`` sets the right side to 0; ``wl + wr < 0`` opens both
    sides; ``(None, 0)`` is causal; any other side set is local, a triangle's ``wl = 0`` included)."""
    if causal:
        wr = 0
    if wl is not None and wr is not None and wl + wr < 0:
        return False
    if wl is None and wr is None:
        return False
    return not (wl is None and wr == 0)


def no_local_hd256(major: int | None, d: int, dv: int) -> bool:
    """Whether FA4 runs head dims ``(d, dv)`` on compute capability ``major`` with its dedicated
    (256, 256) kernels, which take no local attention: SM100 / SM110 ``use_dedicated_hd256_kernel``;
    ``sm100_hd256_2cta_fmha_forward`` / ``_backward`` assert ``not is_local`` (4.0.0b14 to
    4.0.0b36; the backward is not deterministic either)."""
    return major in (10, 11) and (d, dv) == (256, 256)


def gqa_head_dim_reason(major: int, d: int | None, dv: int | None) -> str | None:
    """Why FA4 cannot run a call whose kv heads serve several query heads (GQA / MQA) with head dims
    ``(d, dv)`` (``None``: it can): SM90's backward asserts ``head_dim == head_dim_v`` then."""
    if major == 9 and d is not None and dv is not None and d != dv:
        return (f"FA4's SM90 backward takes GQA calls with one head dim only (flash_bwd_sm90 asserts "
                f"head_dim == head_dim_v), got ({d}, {dv}) with fewer kv heads than query heads")
    return None


class FA4Kernel(Kernel):
    """FlashAttention-4's forward/backward (``flash_attn.cute.interface``), GQA and MLA native.

    Needs the ``fa4`` extra (``pip install 'striped_sp[fa4]'``) and a CUDA device of compute
    capability 9.x or 10.x, float16 or bfloat16."""

    name = "fa4"
    #: v's head dim may differ from q/k's (MLA: (192, 128)): no padding on the ring
    native_value_head_dim = True

    def __init__(self, deterministic: bool = False):
        #: FA4's deterministic backward (SM90 and SM100): no atomic adds into dq / dk / dv
        self.deterministic = deterministic
        self._fns = None  # (fwd, bwd) once their signatures are checked

    # -- the interface, checked once --------------------------------------------------------
    def _functions(self):
        if self._fns is None:
            mod = importlib.import_module(MODULE)
            fns = []
            for fn_name, params in (("_flash_attn_fwd", _FWD_PARAMS), ("_flash_attn_bwd", _BWD_PARAMS)):
                fn = getattr(mod, fn_name, None)
                if fn is None:
                    raise RuntimeError(f"flash-attn-4 {installed_version()} has no {MODULE}.{fn_name}: "
                                       f"striped_sp's backend 'fa4' supports flash-attn-4 {SUPPORTED}")
                have = inspect.signature(getattr(fn, "_init_fn", fn)).parameters
                missing = [p for p in params if p not in have]
                if missing:
                    raise RuntimeError(f"flash-attn-4 {installed_version()}: {MODULE}.{fn_name} has no parameter "
                                       f"{', '.join(missing)}; striped_sp's backend 'fa4' supports flash-attn-4 "
                                       f"{SUPPORTED}")
                fns.append(fn)
            self._fns = tuple(fns)
        return self._fns

    def unavailable_reason(self, device, dtype, head_dim=None):
        why = import_reason()
        if why is not None:
            return why
        cap = _capability(torch.device(device))
        if cap is None:
            return f"FA4 runs on CUDA devices only, got device '{device}'"
        if cap[0] not in (9, 10):
            return f"FA4 runs on compute capability 9.x (Hopper) and 10.x (Blackwell), got {cap[0]}.{cap[1]}"
        if dtype not in _HALF_DTYPES:
            return f"FA4 needs float16 or bfloat16, got {dtype}"
        reason = head_dim_reason(cap[0], *head_dims(head_dim))
        if reason is not None:
            return reason
        try:
            self._functions()
        except Exception as e:  # noqa: BLE001 - a broken install must not break the other backends
            return str(e) if isinstance(e, RuntimeError) else f"flash-attn-4 {installed_version()}: {type(e).__name__}: {e}"
        return None

    def gqa_unavailable_reason(self, device, dtype, head_dim=None):
        cap = _capability(torch.device(device))
        return None if cap is None else gqa_head_dim_reason(cap[0], *head_dims(head_dim))

    def deterministic_reason(self, device):
        cap = _capability(torch.device(device))
        if cap is not None and cap[0] == 9:
            have, need = _release(installed_version()), _release(SM90_DETERMINISTIC_GQA)
            if have is not None and have < need:
                return (f"FA4's deterministic backward on SM90 needs flash-attn-4 >= {SM90_DETERMINISTIC_GQA} "
                        f"(before it a GQA backward sums dK/dV with atomics), installed {installed_version()}")
        return None

    def deterministic_variant(self):
        return self if self.deterministic else _DETERMINISTIC.with_softcap(self.softcap)

    def softcap_unavailable_reason(self):
        return None  # _flash_attn_fwd / _flash_attn_bwd take softcap=

    def _cap(self) -> dict:
        """``softcap=`` for FA4's calls when on (nothing when off: its defaults stay untouched)."""
        return {"softcap": self.softcap} if self.softcap else {}

    def kernel_class(self, device, dtype, head_dim=None, varlen=False):
        return "fa4"

    def causal_alignment(self, device, dtype, head_dim=None):
        return "bottom_right"

    def native_varlen(self, device, dtype, head_dim=None) -> bool:
        return True

    # -- calls ---------------------------------------------------------------------------
    def forward(self, q, k, v, causal, scale):
        fwd, _ = self._functions()
        res = fwd(q, k, v, softmax_scale=scale, causal=causal, window_size_left=None, window_size_right=None,
                  return_lse=True, **self._cap())
        return res[0], res[1]  # lse [b, h, s] fp32, contiguous as allocated

    def backward(self, dout, q, k, v, out, lse, causal, scale):
        _, bwd = self._functions()
        res = bwd(q, k, v, out, dout, lse.contiguous(), softmax_scale=scale, causal=causal, window_size_left=None,
                  window_size_right=None, deterministic=self.deterministic, **self._cap())
        return res[0], res[1], res[2]

    def _local_elsewhere(self, q, v, wl, wr):
        """PyTorch's flash kernel for a local call FA4 cannot run (:func:`no_local_hd256`): packed
        rows at head dims (256, 256) on SM100 run their windows and triangles there, forward and
        backward alike, so that each call's lse comes from the kernel its backward runs on;
        ``None``: FA4 runs the call."""
        cap = _capability(q.device)
        if not (no_local_hd256(cap[0] if cap else None, q.size(-1), v.size(-1))
                and is_local(wl is None and wr == 0, wl, wr)):
            return None
        from .torch_sdpa import TorchKernel, flash_impl, flash_impl_reason

        if self.softcap:
            raise RuntimeError(f"FA4 runs no windowed or packed call at head dims (256, 256) on SM100, and PyTorch's "
                               f"flash op that would run it has no softcap (softcap={self.softcap})")

        why = flash_impl_reason(flash_impl(), cap[0])
        if why is not None:
            raise RuntimeError("FA4 runs no windowed or packed call at head dims (256, 256) on SM100 (its dedicated "
                               f"kernels assert not is_local), and PyTorch's flash op cannot take it here: {why}")
        return TorchKernel()

    def varlen_forward_op(self, q, k, v, cu_q, cu_k, max_q, max_k, wl, wr, scale):
        other = self._local_elsewhere(q, v, wl, wr)
        if other is not None:
            return other.varlen_forward_op(q, k, v, cu_q, cu_k, max_q, max_k, wl, wr, scale)
        fwd, _ = self._functions()
        causal = wl is None and wr == 0
        res = fwd(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
                  softmax_scale=scale, causal=causal, window_size_left=wl, window_size_right=None if causal else wr,
                  return_lse=True, **self._cap())
        return res[0], res[1]

    def varlen_backward_op(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, wl, wr, scale):
        other = self._local_elsewhere(q, v, wl, wr)
        if other is not None:  # flash-attn 2's backward reads a row without keys as lse +inf
            lse = lse.masked_fill(torch.isneginf(lse), float("inf"))
            return other.varlen_backward_op(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, wl, wr, scale)
        _, bwd = self._functions()
        causal = wl is None and wr == 0
        res = bwd(q, k, v, out, dout, lse, softmax_scale=scale, causal=causal, window_size_left=wl,
                  window_size_right=None if causal else wr, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                  max_seqlen_q=max_q, max_seqlen_k=max_k, deterministic=self.deterministic, **self._cap())
        return res[0], res[1], res[2]


_DETERMINISTIC = FA4Kernel(deterministic=True)
