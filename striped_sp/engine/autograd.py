"""Exact ring attention: the autograd function and the merge.

The public entry points, :func:`~striped_sp.engine.request.ring_attention` and
:class:`~striped_sp.engine.request.RingRequest`, check the arguments and call :class:`_RingAttention`."""

from __future__ import annotations

import contextlib

import torch

from ..kernels import Kernel, accumulator_dtype
from ..plan.layouts import Layout
from ..plan.masks import MaskSpec, ring_plans, shared_rows
from .transport import Ring
from .step import Accumulator, backward_step, forward_step, from_format, merge_block, to_format

__all__ = ["_RingAttention"]


@contextlib.contextmanager
def _settle_on_error(*transfers):
    """If a kernel raises, complete the transfers already posted before re-raising, so that a
    failure every rank hits alike (a kernel refusing a shape) leaves no message half-sent."""
    try:
        yield
    except BaseException:
        for transfer in transfers:
            if transfer is not None:
                transfer.wait()
        raise


class _RingAttention(torch.autograd.Function):
    """Forward: KV blocks go round the ring while each rank merges its queries' block results.
    Backward: the ring again; dQ stays local, fp32 dK/dV travel with the blocks and reach their
    owner after ``world_size`` hops.

    Dense (unmasked) forwards run in the kernel's :attr:`~striped_sp.kernels.Kernel.tensor_format`:
    q, k, v are converted once here (K/V travel in it), the output once on the way out.  Backward
    and masked rings (varlen plans) run in ``[b, s, h, d]`` on the caller's tensors.

    Memory (per rank, ``T`` = one local ``[b, s, h, d]`` fp32 tensor; docs/benchmarks.md has the
    measurements): backward keeps only the caller's q, k, v, the returned output and the fp32 lse
    (no format copies; converted copies would be three more ``T`` alive from forward to backward,
    and two more for dout and out in backward); dQ, dK and dV accumulate in place in fp32
    buffers that are returned as the gradients (fp32 inputs); the arriving dK/dV accumulators are
    waited for *before* the step's kernels, so the ones sent the step before are freed first
    (the dK/dV transfer then overlaps with the K/V wait, not the kernels); each kernel call's
    gradients are added and dropped at once, its heads split in two halves
    (:func:`striped_sp.engine.step.head_splits`); a visiting K/V block is dropped once passed on."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout: Layout, causal: bool, scale: float, kernel: Kernel,
                mask: MaskSpec | None = None, grad_comm_dtype: torch.dtype = torch.float32,
                strict_block: str = "sliced", timeout=None):
        ring = Ring(group, timeout)
        n, rank, local_len = ring.world_size, ring.rank, q.size(1)
        plans = _plans(layout, mask, causal, n, rank, local_len)
        # a window that reaches back fewer ranks than the ring holds cuts the ring short
        steps = n if mask is None else layout.ring_steps(n, local_len, mask)
        # only the rows other ranks can see travel (whole documents at the end of a rank stay home)
        shared = None if mask is None or steps == 1 else shared_rows_of(layout, mask, n)
        fmt = "bshd" if mask is not None else kernel.tensor_format
        aligned = strict_block == "aligned"
        qn, k_cur, v_cur = (to_format(t, fmt) for t in (q, k, v))
        acc = Accumulator(qn, masked=mask is not None, fmt=fmt, value_dim=v.size(-1))
        for step in range(steps):
            transfer = _shift_kv(ring, k_cur, v_cur, step, steps, shared, "forward")
            with _settle_on_error(transfer):
                if mask is None:
                    forward_step(kernel, qn, k_cur, v_cur, plans[step], scale, acc, aligned)
                else:
                    for call in plans[step]:
                        kernel.forward_varlen(qn, k_cur, v_cur, call.segments, scale, acc.out, acc.lse)
            k_cur = v_cur = None  # the copies: freed once sent on
            if transfer is not None:
                k_cur, v_cur = transfer.wait()
                transfer = None  # its requests hold the block sent on: free it before the next shift
        del qn, k_cur, v_cur
        out = from_format(acc.out, fmt, q.dtype)  # [b, s, h, d], contiguous
        ctx.save_for_backward(q, k, v, out, acc.lse)
        ctx.group, ctx.plans, ctx.masked, ctx.scale, ctx.kernel = group, plans, mask is not None, scale, kernel
        ctx.grad_comm_dtype, ctx.aligned, ctx.timeout, ctx.steps = grad_comm_dtype, aligned, timeout, steps
        ctx.shared = shared
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors  # [b, s, h, d]: the caller's q, k, v; out as returned
        plans, masked, scale, kernel = ctx.plans, ctx.masked, ctx.scale, ctx.kernel
        ring = Ring(ctx.group, ctx.timeout)
        n, rank, shared = ring.world_size, ring.rank, ctx.shared
        acc = accumulator_dtype(q.dtype)  # float32; float64 for float64 inputs
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        k_cur, v_cur = k, v
        dkv_transfer = None
        own_tail = None  # dK/dV of our rows that never travel (whole documents at the end)
        steps = ctx.steps
        for step in range(steps):
            kv_transfer = _shift_kv(ring, k_cur, v_cur, step, steps, shared, "backward")
            # this block's fp32 dK/dV accumulators: fresh for our own block, else the ones arriving
            # with it (accumulated in fp32 whatever the travel dtype)
            if dkv_transfer is None:
                dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
            else:
                with _settle_on_error(kv_transfer):
                    dk_acc, dv_acc = (t.to(acc) for t in dkv_transfer.wait())
                dkv_transfer = None  # its requests hold what we sent the step before
            with _settle_on_error(kv_transfer):
                if masked:  # varlen calls add into dq, dk_acc, dv_acc in place
                    for call in plans[step]:
                        kernel.backward_varlen(dout, q, k_cur, v_cur, out, lse, call.segments, scale,
                                               dq, dk_acc, dv_acc)
                else:
                    backward_step(kernel, dout, q, k_cur, v_cur, out, lse, plans[step], scale, dq, "bshd",
                                  ctx.aligned, dk=dk_acc, dv=dv_acc, split_heads=True)
            k_cur = v_cur = None  # a visiting block: freed once sent on
            if steps > 1:  # on to the next rank; after the last step, straight home to the owner
                if step == 0 and shared is not None:
                    own_tail = (dk_acc[:, shared[rank]:], dv_acc[:, shared[rank]:])
                    dk_acc, dv_acc = dk_acc[:, :shared[rank]], dv_acc[:, :shared[rank]]
                last = step == steps - 1
                home = None if shared is None else shared[rank if last else (rank - step - 1) % n]
                dkv_transfer = ring.shift([dk_acc.to(ctx.grad_comm_dtype), dv_acc.to(ctx.grad_comm_dtype)],
                                          f"backward step {step + 1} of {steps} (dK/dV)",
                                          hops=n - step if last else 1, recv_rows=home)
                dk_acc = dv_acc = None
            if kv_transfer is not None:
                k_cur, v_cur = kv_transfer.wait()
                kv_transfer = None  # its requests hold the block sent on: free it before the next shift
        if dkv_transfer is not None:
            dk_acc, dv_acc = dkv_transfer.wait()  # our own blocks' gradients, home after n hops
            if own_tail is not None and own_tail[0].size(1):
                dk_acc = torch.cat([dk_acc.to(own_tail[0].dtype), own_tail[0]], 1)
                dv_acc = torch.cat([dv_acc.to(own_tail[1].dtype), own_tail[1]], 1)
        return (dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype),
                None, None, None, None, None, None, None, None, None)


def _shift_kv(ring: Ring, k_cur, v_cur, step: int, steps: int, shared: list[int] | None, what: str):
    """Send the K/V block held at ``step`` on (our own block: only its shared rows) and receive the
    next one; ``None`` after the last step."""
    if step >= steps - 1:
        return None
    n, rank = ring.world_size, ring.rank
    send = [k_cur, v_cur] if step or shared is None else [t[:, :shared[rank]] for t in (k_cur, v_cur)]
    return ring.shift(send, f"{what} step {step + 1} of {steps} (keys/values)",
                      recv_rows=None if shared is None else shared[(rank - step - 1) % n])


def shared_rows_of(layout: Layout, mask: MaskSpec, n: int) -> list[int] | None:
    """Per rank, the rows the ring carries (:func:`striped_sp.plan.masks.shared_rows`); ``None`` when
    every rank shares all of them (the plain ring).  Cached like the plans: every layer reuses it."""
    key = (layout.key, mask, n)
    if key not in _SHARED:
        shared = [shared_rows(layout, mask, n, r) for r in range(n)]
        if len(_SHARED) >= 16:
            _SHARED.pop(next(iter(_SHARED)))
        _SHARED[key] = None if all(s == mask.seq_len // n for s in shared) else shared
    return _SHARED[key]


_SHARED: dict = {}


def _plans(layout: Layout, mask: MaskSpec | None, causal: bool, n: int, rank: int, local_len: int) -> list:
    """``plans[t]``: the kernel calls of ring step ``t`` (source ``(rank - t) % n``)."""
    if mask is not None:
        return ring_plans(layout, mask, n, rank)
    return [layout.plan(rank, (rank - t) % n, n, local_len, causal) for t in range(n)]
