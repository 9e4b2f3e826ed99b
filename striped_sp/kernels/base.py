"""The block-kernel interface every backend implements (the base module of :mod:`striped_sp.kernels`).

Every kernel works on the core format ``[batch, seq, heads, head_dim]``; keys/values may have
fewer heads (GQA/MQA: query head ``h`` uses kv head ``h // (heads // kv_heads)``).

``forward(q, k, v, causal, scale) -> (out, lse)``
    ``out``: like ``q``, in ``q.dtype``; ``lse``: ``[batch, heads, seq_q]``, contiguous, in
    :func:`accumulator_dtype` (float32; float64 for float64 inputs).
``backward(dout, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)``
    ``out``/``lse`` are the *final* (merged) attention output and log-sum-exp of these query
    rows, so the block's gradients are its exact share of the full attention's gradients.
    ``dq``/``dk``/``dv`` have the shapes of ``q``/``k``/``v`` (kv heads, not expanded).

A causal call is square (``seq_q == seq_k``, diagonal kept), except the aligned strict block
(``n`` queries x ``n - 1`` keys) on kernels whose :meth:`Kernel.causal_alignment` is bottom-right.

``forward_native`` / ``backward_native`` are the same calls on tensors in the kernel's
:attr:`Kernel.tensor_format` (``"bshd"``, or ``"bhsd"`` = ``[batch, heads, seq, head_dim]`` for
PyTorch's SDPA ops): the ring converts once at entry and calls these (:mod:`striped_sp.engine.step`).

Logit soft-capping (Gemma 2's ``attn_logit_softcapping``): every score ``s`` becomes
``c * tanh(s / c)`` before the softmax.  It is elementwise on the scores, so only a kernel can apply
it: a kernel that can says so (:meth:`Kernel.softcap_unavailable_reason` is ``None``) and
:meth:`Kernel.with_softcap` gives the instance whose every call (dense, masked, varlen) applies
``softcap`` (float; 0.0 = off), forward and backward.

Packed documents and sliding windows add two entry points (:mod:`striped_sp.kernels.varlen`):

``forward_varlen(q, k, v, segments, scale, acc_out, acc_lse)`` / ``backward_varlen(dout, q, k, v, out, lse, segments, scale, dq, dk, dv)``
    many band segments (:class:`striped_sp.plan.masks.Segments`) of the whole local tensors, merged
    into float32 accumulators ``acc_out`` ``[b, s, h, d]`` / ``acc_lse`` ``[b, h, s]`` (forward)
    or added into float32 ``dq`` / ``dk`` / ``dv`` (backward).  Kernels with a native varlen
    function (flash-attn, PyTorch's CUDA flash op) run it once per window class; the others cover
    the segments with direct calls and batched masked calls (:mod:`striped_sp.kernels.schedule`):
``forward_masked(q, k, v, mask, scale)`` / ``backward_masked(dout, q, k, v, out, lse, mask, scale)``
    ``mask``: bool ``[batch or 1, 1, seq_q, seq_k]``, True = visible; every row sees a key; or
    what :meth:`Kernel.compile_mask` made of one.
"""

from __future__ import annotations

import copy

import torch

__all__ = ["Kernel", "accumulator_dtype", "head_dims", "flash2_window"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of log-sum-exps and of the ring's accumulators (out, dQ, dK/dV) for inputs of
    ``dtype``: float64 for float64 (computed in float64 end to end), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def head_dims(head_dim) -> tuple[int | None, int | None]:
    """``(d, dv)``: the query/key and value head dims of a ``head_dim`` argument, which is an int
    (both), a pair ``(d, dv)`` (multi-latent attention) or ``None`` (unknown)."""
    if head_dim is None or isinstance(head_dim, int):
        return head_dim, head_dim
    d, dv = head_dim
    return d, dv


def flash2_window(wl: int | None, wr: int | None) -> tuple[int, int]:
    """A window in the neutral form (``None`` = an open side) as flash-attn 2 and PyTorch's flash
    varlen op take it (``-1`` = an open side)."""
    return (-1 if wl is None else wl), (-1 if wr is None else wr)


def _group_sum(dkv_expanded: torch.Tensor, kv_heads: int, dim: int = 2) -> torch.Tensor:
    """Sum gradients of expanded kv heads (``kv_heads * g`` at ``dim``: 2 in ``[b, s, h, d]``,
    1 in ``[b, h, s, d]``) back to ``kv_heads``."""
    h = dkv_expanded.size(dim)
    if h == kv_heads:
        return dkv_expanded
    shape = dkv_expanded.shape
    return dkv_expanded.reshape(*shape[:dim], kv_heads, h // kv_heads, *shape[dim + 1:]).sum(dim=dim + 1)


def _expand_kv(x: torch.Tensor, heads: int, dim: int = 2) -> torch.Tensor:
    if x.size(dim) == heads:
        return x
    return x.repeat_interleave(heads // x.size(dim), dim=dim)


class Kernel:
    """Interface of a block kernel.  ``name`` is the ``backend=`` string that selects it."""

    name = ""
    #: the memory format the ring hands to :meth:`forward_native` / :meth:`backward_native`:
    #: ``"bshd"`` or ``"bhsd"`` (:mod:`striped_sp.engine.step`)
    tensor_format = "bshd"
    #: the striped strict block's form unless ``$STRIPED_SP_STRICT_BLOCK`` says otherwise
    default_strict_block = "sliced"
    #: whether every call takes ``v`` with a head dim other than q/k's (multi-latent attention:
    #: ``out`` then has v's).  ``False``: the ring zero-pads to one head dim at entry and slices
    #: the output (:func:`striped_sp.ring_attention`)
    native_value_head_dim = False
    #: the logit soft-cap ``c`` every call of this instance applies (``c * tanh(s / c)`` on every
    #: score before the softmax); 0.0 = off.  Set only through :meth:`with_softcap`
    softcap = 0.0

    def softcap_unavailable_reason(self) -> str | None:
        """``None`` when this kernel applies logit soft-capping inside its calls (forward and
        backward), else why not (default: it cannot)."""
        return "it has no logit soft-capping (its scores never leave the fused op)"

    def with_softcap(self, softcap: float | None) -> "Kernel":
        """This kernel with every call soft-capping its scores at ``softcap`` (``None`` / 0: itself,
        uncapped); one instance per value, kept on the kernel, so plans keyed by it are reused.
        ``ValueError`` where :meth:`softcap_unavailable_reason` says it cannot."""
        if not softcap:
            return self
        why = self.softcap_unavailable_reason()
        if why is not None:
            raise ValueError(f"backend {self.name!r} cannot apply softcap={softcap!r}: {why}")
        variants = self.__dict__.setdefault("_softcap_variants", {})
        found = variants.get(float(softcap))
        if found is None:
            found = copy.copy(self)
            found.__dict__.pop("_softcap_variants", None)
            found.softcap = float(softcap)
            variants[float(softcap)] = found
        return found

    def unavailable_reason(self, device: torch.device, dtype: torch.dtype, head_dim=None) -> str | None:
        """``None`` when the kernel runs on ``device`` with ``dtype`` (and ``head_dim``: an int, or
        ``(d, dv)`` where q/k and v head dims differ, see :func:`head_dims`), else why not."""
        raise NotImplementedError

    def gqa_unavailable_reason(self, device: torch.device, dtype: torch.dtype, head_dim=None) -> str | None:
        """Beyond :meth:`unavailable_reason`: why the kernel cannot run calls whose kv heads each serve
        several query heads (GQA / MQA) with ``head_dim`` on ``device`` (``None``: it can)."""
        return None

    def auto_reason(self, device: torch.device, dtype: torch.dtype, head_dim=None) -> str | None:
        """Why ``backend="auto"`` passes this kernel over on ``device`` although it runs there
        (``None``: auto ranks it by :meth:`kernel_class`); naming the backend still runs it."""
        return None

    def deterministic_reason(self, device: torch.device) -> str | None:
        """Why this kernel has no deterministic backward on ``device`` (``None``: it has one,
        :meth:`deterministic_variant`)."""
        return None

    def deterministic_variant(self) -> "Kernel":
        """This kernel with a bitwise-reproducible backward (itself where that is already so)."""
        return self

    def kernel_class(self, device: torch.device, dtype: torch.dtype, head_dim=None, varlen: bool = False) -> str:
        """Which class of kernel runs this backend's calls on ``device`` (``varlen``: its packed /
        windowed calls): a name in :data:`striped_sp.kernels.AUTO_ORDER`, by which ``backend="auto"``
        ranks the available backends."""
        return self.name

    def causal_alignment(self, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> str:
        """How a non-square causal call aligns its mask: ``"top_left"`` (query ``i`` sees keys
        ``<= i``), ``"bottom_right"`` (keys ``<= i + sk - sq``, flash-attn >= 2.1) or ``"unknown"``."""
        return "top_left"

    def forward(self, q, k, v, causal: bool, scale: float):
        raise NotImplementedError

    def backward(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        raise NotImplementedError

    def forward_native(self, q, k, v, causal: bool, scale: float):
        """:meth:`forward` on tensors in :attr:`tensor_format` (out in it too, lse ``[b, h, s]``, in
        any strides: its callers merge it, so a copy to contiguous would be wasted)."""
        return self.forward(q, k, v, causal, scale)

    def backward_native(self, dout, q, k, v, out, lse, causal: bool, scale: float):
        """:meth:`backward` on tensors in :attr:`tensor_format`."""
        return self.backward(dout, q, k, v, out, lse, causal, scale)

    def varlen_unavailable_reason(self) -> str | None:
        """``None`` when :meth:`forward_varlen` / :meth:`backward_varlen` run, else why not."""
        return None

    def compile_mask(self, mask: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The form of a bool ``mask`` that :meth:`forward_masked` / :meth:`backward_masked` take
        fastest on ``device`` with inputs of ``dtype``, built once per batch when a program is
        compiled (default: the bool mask itself)."""
        return mask

    def forward_masked(self, q, k, v, mask, scale: float):
        raise NotImplementedError(f"backend {self.name!r} has no masked attention call")

    def backward_masked(self, dout, q, k, v, out, lse, mask, scale: float):
        raise NotImplementedError(f"backend {self.name!r} has no masked attention call")

    def native_varlen(self, device: torch.device, dtype: torch.dtype, head_dim: int | None = None) -> bool:
        """Whether varlen calls run on this kernel's own varlen entry point
        (:meth:`varlen_forward_op` / :meth:`varlen_backward_op`) on ``device`` / ``dtype``; else they
        run through the schedule of direct and masked calls (:mod:`striped_sp.kernels.varlen`)."""
        return False

    def varlen_forward_op(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, wl: int | None, wr: int | None,
                          scale: float):
        """The kernel's varlen forward: ``q`` ``[T, h, d]``, ``k``/``v`` ``[Tk, kv_heads, d]``, int32
        ``cu_q`` / ``cu_k``, ``max_q`` / ``max_k`` at least every segment's length, a bottom-right
        aligned window ``(wl, wr)`` in the neutral form (``None`` = an open side; ``(None, 0)`` is
        causal; :func:`flash2_window` gives flash-attn 2's ``-1`` form) -> ``(out [T, h, dv], lse [h, T])``."""
        raise NotImplementedError(f"backend {self.name!r} has no varlen entry point")

    def varlen_backward_op(self, dout, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, wl: int | None,
                           wr: int | None, scale: float):
        """The kernel's varlen backward -> ``(dq, dk, dv)`` (kv heads not expanded)."""
        raise NotImplementedError(f"backend {self.name!r} has no varlen entry point")

    def forward_varlen(self, q, k, v, program, scale: float, acc_out, acc_lse) -> None:
        """``program``: a call compiled by :func:`striped_sp.kernels.varlen.compile_call` (or plain
        :class:`~striped_sp.kernels.segments.Segments`, compiled for this call)."""
        from .varlen import as_program

        as_program(self, program, q, k).forward(self, q, k, v, scale, acc_out, acc_lse)

    def backward_varlen(self, dout, q, k, v, out, lse, program, scale: float, dq, dk, dv) -> None:
        from .varlen import as_program

        as_program(self, program, q, k).backward(self, dout, q, k, v, out, lse, scale, dq, dk, dv)
