"""The executor: a :class:`~striped_sp.plan.ring_plan.RingPlan` run over a transport, forward and
backward, and the autograd function around it.

:func:`forward_steps` and :func:`backward_steps` are generators that yield each transfer just before
they wait for it (:mod:`striped_sp.engine.transport`): on a process group
:func:`~striped_sp.engine.transport.drive` simply resumes them, on a
:class:`~striped_sp.engine.transport.LocalRing` all ranks run side by side to their next wait
(:func:`~striped_sp.engine.transport.run_local`).  So the one executor is also the simulator.  The
generators wait themselves, so that no driver holds a received block (or a transfer whose requests
hold a sent one) a step longer than the ring needs it.

Per step the executor runs the plan's precompiled calls and nothing else: no planning, no copy to
the device, no synchronisation; host work per step is O(kernel calls).

The public entry points, :func:`~striped_sp.engine.request.ring_attention` and
:class:`~striped_sp.engine.request.RingRequest`, check the arguments, fetch the batch's plan and
call :class:`RingAttention`.
"""

from __future__ import annotations

import contextlib

import torch

from ..kernels import accumulator_dtype
from ..kernels.merge import fold_sinks, sink_grad
from ..plan.ring_plan import RingPlan
from .run_order import dense_backward, from_run_format, rows_in, to_run_format
from .step import Accumulator, backward_step, forward_step
from .transport import Transport, drive

__all__ = ["RingAttention", "forward_steps", "backward_steps"]


@contextlib.contextmanager
def _settle_on_error(*transfers):
    """If a kernel raises, complete the transfers already posted before re-raising, so that a
    failure every rank hits alike (a kernel refusing a shape) leaves no message half-sent."""
    try:
        yield
    except BaseException:
        for transfer in transfers:
            if transfer is not None:
                transfer.settle()
        raise


def _shift_kv(transport: Transport, k_cur, v_cur, step: int, plan: RingPlan, what: str):
    """Send the K/V block held at ``step`` on (our own block: only its shared rows) and receive the
    next one; ``None`` after the last step."""
    steps, shared = plan.steps, plan.shared
    if step >= steps - 1:
        return None
    n, rank = plan.world_size, plan.rank
    send = [k_cur, v_cur] if step or shared is None else [t[:, :shared[rank]] for t in (k_cur, v_cur)]
    return transport.shift(send, f"{what} step {step + 1} of {steps} (keys/values)",
                           recv_rows=None if shared is None else shared[(rank - step - 1) % n])


def forward_steps(q, k, v, plan: RingPlan, transport: Transport, sinks: torch.Tensor | None = None):
    """Generator of the forward ring; returns ``(out, lse)``: ``out`` ``[b, s, h, dv]`` contiguous in
    ``q.dtype``, ``lse`` ``[b, h, s]`` fp32 (fp64 for fp64 inputs).

    ``sinks`` ``[h]`` (this ring's query heads): one sink logit per head, folded into the merged
    accumulators once after the last step (:func:`striped_sp.kernels.merge.fold_sinks`); ``out`` and
    ``lse`` are then the sink softmax's, which :func:`backward_steps` takes unchanged.

    Dense plans run in the kernel's :attr:`~striped_sp.kernels.Kernel.tensor_format`: q, k, v are
    converted once here (K/V travel in it), the output once on the way out; masked plans run in
    ``[b, s, h, d]`` on the caller's tensors."""
    kernel, scale, fmt = plan.kernel, plan.scale, plan.fmt
    qn, k_cur, v_cur = (to_run_format(t, plan.order, fmt) for t in (q, k, v))  # plan.order: engine/run_order.py
    acc = Accumulator(qn, masked=plan.masked, fmt=fmt, value_dim=v.size(-1))
    for step in range(plan.steps):
        transfer = _shift_kv(transport, k_cur, v_cur, step, plan, "forward")
        with _settle_on_error(transfer):
            if plan.masked:
                for program in plan.programs[step]:
                    kernel.forward_varlen(qn, k_cur, v_cur, program, scale, acc.out, acc.lse)
            else:
                forward_step(kernel, qn, k_cur, v_cur, plan.calls[step], scale, acc, plan.aligned)
        k_cur = v_cur = None  # the copies: freed once sent on
        if transfer is not None:
            yield transfer
            k_cur, v_cur = transfer.wait()
            transfer = None  # its requests hold the block sent on: free it before the next shift
    del qn, k_cur, v_cur
    if sinks is not None:  # once per row, after the last step: the merge's one sink
        fold_sinks(acc.out, acc.lse, sinks, fmt)
    return from_run_format(acc.out, plan.inverse, fmt, q.dtype), rows_in(plan.inverse, acc.lse, dim=2)[0]


def backward_steps(dout, q, k, v, out, lse, plan: RingPlan, transport: Transport):
    """Generator of the backward ring (``[b, s, h, d]`` tensors, ``out``/``lse`` the forward's);
    returns ``(dq, dk, dv)`` in the inputs' dtypes.  dQ stays local; fp32 dK/dV accumulators travel
    with the blocks (in ``plan.comm_dtype``) and reach their owner after the last step.

    Memory: the arriving dK/dV accumulators are waited for *before* the step's kernels, so the ones
    sent the step before are freed first; each kernel call's gradients are added and dropped at
    once, its heads split in two halves (:func:`striped_sp.engine.step.head_splits`); a visiting
    K/V block is dropped once passed on.  Masked plans take the caller's tensors contiguous (a
    copy of those that are not, for the pass): their calls gather rows, and gathering from a
    strided view (``[s, b, ...]`` storage with ``b > 1``) copies the whole tensor each time.  Dense
    plans copy only a tensor whose head dim is not unit-strided (the kernels' precondition)."""
    kernel, scale, steps, shared = plan.kernel, plan.scale, plan.steps, plan.shared
    n, rank = plan.world_size, plan.rank
    if plan.order is not None and not plan.masked:  # a ring of one in run order (engine/run_order.py)
        return dense_backward(dout, q, k, v, out, lse, plan)
    dout, q, k, v, out = rows_in(plan.order, dout, q, k, v, out)  # the plan's run order (engine/run_order.py)
    lse, = rows_in(plan.order, lse, dim=2)
    if plan.masked:
        dout, q, k, v = (t.contiguous() for t in (dout, q, k, v))
    else:  # the fused kernels' backward needs a unit stride along the head dim (a strided or [b, s, d, h]
        # view gave wrong gradients silently): copy only a tensor that lacks it, never a [b, s, h, d] /
        # [s, b, h, d] view
        dout, q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (dout, q, k, v))
    acc = accumulator_dtype(q.dtype)  # float32; float64 for float64 inputs
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_cur, v_cur = k, v
    dkv_transfer = None
    own_tail = None  # dK/dV of our rows that never travel (whole documents at the end)
    dk_acc = dv_acc = None
    for step in range(steps):
        kv_transfer = _shift_kv(transport, k_cur, v_cur, step, plan, "backward")
        # this block's fp32 dK/dV accumulators: fresh for our own block, else the ones arriving
        # with it (accumulated in fp32 whatever the travel dtype)
        if dkv_transfer is None:
            dk_acc = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv_acc = torch.zeros(v.shape, dtype=acc, device=v.device)
        else:
            with _settle_on_error(kv_transfer):
                yield dkv_transfer
                dk_acc, dv_acc = (t.to(acc) for t in dkv_transfer.wait())
            dkv_transfer = None  # its requests hold what we sent the step before
        with _settle_on_error(kv_transfer):
            if plan.masked:  # varlen calls add into dq, dk_acc, dv_acc in place
                for program in plan.programs[step]:
                    kernel.backward_varlen(dout, q, k_cur, v_cur, out, lse, program, scale, dq, dk_acc, dv_acc)
            else:
                backward_step(kernel, dout, q, k_cur, v_cur, out, lse, plan.calls[step], scale, dq, "bshd",
                              plan.aligned, dk=dk_acc, dv=dv_acc, split_heads=True)
        k_cur = v_cur = None  # a visiting block: freed once sent on
        if steps > 1:  # on to the next rank; after the last step, straight home to the owner
            if step == 0 and shared is not None:
                own_tail = (dk_acc[:, shared[rank]:], dv_acc[:, shared[rank]:])
                dk_acc, dv_acc = dk_acc[:, :shared[rank]], dv_acc[:, :shared[rank]]
            last = step == steps - 1
            home = None if shared is None else shared[rank if last else (rank - step - 1) % n]
            dkv_transfer = transport.shift([dk_acc.to(plan.comm_dtype), dv_acc.to(plan.comm_dtype)],
                                           f"backward step {step + 1} of {steps} (dK/dV)",
                                           hops=n - step if last else 1, recv_rows=home)
            dk_acc = dv_acc = None
        if kv_transfer is not None:
            yield kv_transfer
            k_cur, v_cur = kv_transfer.wait()
            kv_transfer = None  # its requests hold the block sent on: free it before the next shift
    if dkv_transfer is not None:
        yield dkv_transfer
        dk_acc, dv_acc = dkv_transfer.wait()  # our own blocks' gradients, home after n hops
        if own_tail is not None and own_tail[0].size(1):
            dk_acc = torch.cat([dk_acc.to(own_tail[0].dtype), own_tail[0]], 1)
            dv_acc = torch.cat([dv_acc.to(own_tail[1].dtype), own_tail[1]], 1)
    return rows_in(plan.inverse, dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype))


class RingAttention(torch.autograd.Function):
    """``RingAttention.apply(q, k, v, plan, transport, sinks=None)`` -> ``[b, s, h, dv]``: the plan
    run over a blocking transport, forward and backward.  ``sinks`` ``[h]`` (any float dtype, on
    q's device): sink logits folded once after the ring (:func:`forward_steps`); their gradient is
    this rank's rows' part (:func:`striped_sp.kernels.merge.sink_grad`, accumulated in float32 and
    returned in ``sinks.dtype``), summed over the ranks by the framework's reduction as every
    replicated parameter's is.

    Memory (per rank, ``T`` = one local ``[b, s, h, d]`` fp32 tensor): backward keeps only the
    caller's q, k, v, the returned output and the fp32 lse (no format copies; converted copies
    would be three more ``T`` alive from forward to backward, and two more for dout and out in
    backward); dQ, dK and dV accumulate in place in fp32 buffers that are returned as the gradients
    (fp32 inputs)."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, transport: Transport, sinks: torch.Tensor | None = None):
        out, lse = drive(forward_steps(q, k, v, plan, transport, sinks))
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan, ctx.transport = plan, transport
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dq, dk, dv = drive(backward_steps(dout, q, k, v, out, lse, ctx.plan, ctx.transport))
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[5]:
            dsinks = sink_grad(dout, out, lse, sinks).to(sinks.dtype)
        return dq, dk, dv, None, None, dsinks
