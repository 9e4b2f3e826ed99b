"""One rank's work in one ring step: the block's kernel calls and their fp32 merge, forward and
backward, in the kernel's own tensor format.  The ring (:mod:`striped_sp.engine.autograd`) and the
one-device simulator (:mod:`striped_sp.bench.sim`) both run these functions.

Tensor formats (:attr:`striped_sp.kernels.Kernel.tensor_format`):

* ``"bshd"``: ``[batch, seq, heads, head_dim]``, the public format (flash-attn's);
* ``"bhsd"``: ``[batch, heads, seq, head_dim]``, what PyTorch's SDPA ops take (the CPU flash op
  runs a 4096-token causal block 10-12% faster on contiguous ``bhsd`` than on a transposed
  ``bshd`` view; docs/tuning.md, "Kernels").

The ring's forward converts q, k, v to the kernel's format once at entry (K/V travel in it) and
the output back once at exit; the plans' slices stay views.  Its backward runs in ``"bshd"`` on the
caller's tensors (:func:`backward_step` takes any kernel there): format copies alive from forward
to backward would cost more memory than the faster calls save (docs/tuning.md, "Memory").
Log-sum-exps are float32
(float64 for float64 inputs, :func:`~striped_sp.kernels.accumulator_dtype`)
``[batch, heads, seq]``.

The striped strict block (keys strictly before the queries, ``b < a``) has two forms:

* ``"sliced"``: the square causal call ``q[1:]`` x ``k[:-1]`` (every kernel);
* ``"aligned"``: all ``n`` queries against ``k[:-1]`` with a bottom-right aligned causal mask, so
  the query length stays the shard length (a kernel's tile multiple); the first row sees no key
  and is dropped from the merge (its lse set to -inf).  Only for kernels whose non-square causal
  mask is bottom-right aligned (:attr:`~striped_sp.kernels.Kernel.causal_alignment`).
"""

from __future__ import annotations

import os

import torch
from ..kernels import accumulator_dtype
from ..kernels.merge import merge_block, merge_block_safe

__all__ = ["merge_block", "merge_block_safe", "Accumulator", "to_format", "from_format", "seq_slice",
           "forward_step", "backward_step", "head_splits", "strict_block_mode", "STRICT_BLOCK_ENV"]

STRICT_BLOCK_ENV = "STRIPED_SP_STRICT_BLOCK"
_ALL = slice(None)


def to_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """``x`` ``[b, s, h, d]`` in ``fmt``, contiguous (a copy unless already so)."""
    return (x if fmt == "bshd" else x.transpose(1, 2)).contiguous()


def from_format(x: torch.Tensor, fmt: str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x`` in ``fmt`` back to a contiguous ``[b, s, h, d]`` of ``dtype`` (one copy at most:
    none for a contiguous ``bshd`` tensor of that dtype)."""
    dtype = dtype or x.dtype
    if fmt == "bshd":
        return x.to(dtype).contiguous()
    view = x.transpose(1, 2)
    return torch.empty(view.shape, dtype=dtype, device=x.device).copy_(view)


def seq_slice(x: torch.Tensor, rows: slice, fmt: str) -> torch.Tensor:
    """The view of sequence rows ``rows`` of ``x`` in ``fmt``."""
    return x[:, rows] if fmt == "bshd" else x[:, :, rows]


class Accumulator:
    """fp32 running output (the shape and format of ``q``, with head dim ``value_dim`` when v's
    differs) and log-sum-exp ``[b, h, s]`` of the local queries."""

    def __init__(self, q: torch.Tensor, masked: bool = False, fmt: str = "bshd", value_dim: int | None = None):
        self.shape, self.fmt = torch.Size((*q.shape[:-1], value_dim or q.size(-1))), fmt
        self.out: torch.Tensor | None = None
        self.lse: torch.Tensor | None = None
        self.merge = merge_block
        if masked:
            # Under a mask the varlen calls merge rows straight into these (logaddexp merge).
            b, s, h = (q.size(0), q.size(1), q.size(2)) if fmt == "bshd" else (q.size(0), q.size(2), q.size(1))
            acc = accumulator_dtype(q.dtype)  # float32; float64 for float64 inputs
            self.out = torch.zeros(self.shape, dtype=acc, device=q.device)
            self.lse = torch.full((b, h, s), float("-inf"), dtype=acc, device=q.device)

    def add(self, q_rows: slice, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
        if self.out is None:
            # The first call is the diagonal block (source == rank), which every layout runs
            # over all local queries; starting from it avoids -inf arithmetic.
            if block_out.shape == self.shape:
                self.out = block_out.to(accumulator_dtype(block_out.dtype))
                self.lse = block_lse.clone(memory_format=torch.contiguous_format)
                return
            # a grouped ring's diagonal is one call per Ulysses member (plan/grouped.py), each over
            # its own rows: start from empty rows and merge with the -inf-safe update
            self.out = torch.zeros(self.shape, dtype=accumulator_dtype(block_out.dtype), device=block_out.device)
            b, h, s = block_lse.size(0), block_lse.size(1), self.shape[1 if self.fmt == "bshd" else 2]
            self.lse = torch.full((b, h, s), float("-inf"), dtype=self.out.dtype, device=block_out.device)
            self.merge = merge_block_safe
        self.merge(seq_slice(self.out, q_rows, self.fmt), self.lse[:, :, q_rows], block_out, block_lse, self.fmt)


def _aligned(call, aligned: bool) -> bool:
    return aligned and getattr(call, "strict", False)


def forward_step(kernel, q, k, v, calls, scale: float, acc: Accumulator, aligned: bool = False) -> None:
    """Run ``calls`` (:class:`striped_sp.plan.layouts.BlockCall`) of one ring step in ``acc.fmt``
    (``q`` ``[b, s, h, d]`` or ``[b, h, s, d]``, ``k``/``v`` with kv heads) and merge each result
    into ``acc``.  ``aligned``: strict calls run in the aligned form (module docstring)."""
    fmt = acc.fmt
    for call in calls:
        if _aligned(call, aligned):
            out, lse = kernel.forward_native(q, seq_slice(k, call.kv, fmt), seq_slice(v, call.kv, fmt), True, scale)
            # the first query sees no key: flash kernels report lse +inf and out 0 or NaN for it
            lse[:, :, 0] = float("-inf")
            seq_slice(out, slice(0, 1), fmt).zero_()
            acc.add(_ALL, out, lse)
            continue
        out, lse = kernel.forward_native(seq_slice(q, call.q, fmt), seq_slice(k, call.kv, fmt),
                                         seq_slice(v, call.kv, fmt), call.causal, scale)
        acc.add(call.q, out, lse)


def head_splits(heads: int, kv_heads: int) -> list[tuple[slice, slice]]:
    """``[(query heads, kv heads), ...]``: the parts a backward call is split into so that the
    kernel's gradient outputs are half the size (attention is independent per head, so the split
    is exact).  Two halves when the kv heads split evenly (or there is one kv head, which both
    halves share and whose gradients add); else one part, the whole call."""
    if heads % 2 or (kv_heads % 2 and kv_heads != 1):
        return [(_ALL, _ALL)]
    hq, hk = heads // 2, max(kv_heads // 2, 1)
    return [(slice(0, hq), slice(0, hk)), (slice(hq, heads), slice(hk if kv_heads > 1 else 0, kv_heads))]


def _heads(x: torch.Tensor, part: slice, fmt: str) -> torch.Tensor:
    return x[:, :, part] if fmt == "bshd" else x[:, part]


def backward_step(kernel, dout, q, k, v, out, lse, calls, scale: float, dq: torch.Tensor, fmt: str = "bshd",
                  aligned: bool = False, dk: torch.Tensor | None = None, dv: torch.Tensor | None = None,
                  split_heads: bool = False) -> list:
    """The kernel backward of ``calls`` with the final ``out``/``lse``: adds into the float32
    ``dq`` (in ``fmt``) and returns ``[(kv_rows, dk, dv), ...]``, this block's key gradients;
    given float32 accumulators ``dk``/``dv`` (in ``fmt``) it adds them there instead (each call's
    gradients are freed at once) and returns ``[]``.

    ``fmt`` is the kernel's :attr:`~striped_sp.kernels.Kernel.tensor_format`, or ``"bshd"`` for
    any kernel (its ``[b, s, h, d]`` entry point; PyTorch's ops then get transposed views).
    ``split_heads`` (with ``dk``/``dv``): each call runs in the :func:`head_splits` parts, which
    halves the kernel's gradient outputs held at once."""
    native = fmt == kernel.tensor_format
    if not native and fmt != "bshd":
        raise ValueError(f"backward_step: format {fmt!r} is neither 'bshd' nor the kernel's {kernel.tensor_format!r}")
    run = kernel.backward_native if native else kernel.backward
    into = dk is not None
    h, kvh = (q.size(2), k.size(2)) if fmt == "bshd" else (q.size(1), k.size(1))
    parts = head_splits(h, kvh) if into and split_heads else [(_ALL, _ALL)]
    grads = []
    for call in calls:
        rows = _ALL if _aligned(call, aligned) else call.q
        for hq, hk in parts:
            dq_b, dk_b, dv_b = run(*(_heads(seq_slice(t, rows, fmt), hq, fmt) for t in (dout, q)),
                                   *(_heads(seq_slice(t, call.kv, fmt), hk, fmt) for t in (k, v)),
                                   _heads(seq_slice(out, rows, fmt), hq, fmt), lse[:, hq, rows], call.causal, scale)
            _heads(seq_slice(dq, rows, fmt), hq, fmt).add_(dq_b)
            if into:
                _heads(seq_slice(dk, call.kv, fmt), hk, fmt).add_(dk_b)
                _heads(seq_slice(dv, call.kv, fmt), hk, fmt).add_(dv_b)
            else:
                grads.append((call.kv, dk_b, dv_b))
            del dq_b, dk_b, dv_b
    return grads


def strict_block_mode(kernel, device: torch.device, dtype: torch.dtype, head_dim: int | None = None,
                      requested: str | None = None, applies: bool = True) -> str:
    """``"sliced"`` or ``"aligned"``: ``requested`` (else ``$STRIPED_SP_STRICT_BLOCK``, else the
    kernel's default).  ``ValueError`` for an unknown form, or ``"aligned"`` on a kernel whose
    non-square causal mask is not bottom-right aligned.  ``applies=False`` (a ring with no strict
    block: not striped, not causal, or masked): the form is checked by name only."""
    env = os.environ.get(STRICT_BLOCK_ENV, "")
    mode = requested or env or kernel.default_strict_block
    source = "requested" if requested else f"from ${STRICT_BLOCK_ENV}" if env else f"{kernel.name}'s default"
    if mode not in ("sliced", "aligned"):
        raise ValueError(f"strict block form {mode!r} ({source}) must be 'sliced' or 'aligned'")
    if mode == "aligned" and not applies:
        return "sliced"
    if mode == "aligned":
        alignment = kernel.causal_alignment(device, dtype, head_dim)
        if alignment != "bottom_right":
            raise ValueError(
                f"strict block form 'aligned' ({source}) needs a kernel whose non-square causal mask is bottom-right "
                f"aligned; backend {kernel.name!r} on {device.type} with {dtype} aligns it {alignment}: "
                "use 'sliced'")
    return mode
