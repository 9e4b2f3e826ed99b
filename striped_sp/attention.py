"""Exact ring attention: the autograd function, the merge and the public entry points."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .agreement import agree, check_ranks_enabled
from .kernels import Kernel, accumulator_dtype, gqa_probe_enabled, resolve_kernel
from .layouts import Layout, get_layout
from .masks import MaskSpec, make_mask, ring_plans
from .ring import Ring, ring_timeout
from .step import (Accumulator, backward_step, forward_step, from_format, merge_block, strict_block_mode,
                   to_format)
from .ulysses import (GroupedLayout, check_ulysses, check_ulysses_groups, heads_to_seq, seq_to_heads,
                      ulysses_ring_groups)

__all__ = ["ring_attention", "striped_attention", "merge_block"]


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
    (:func:`striped_sp.step.head_splits`); a visiting K/V block is dropped once passed on."""

    @staticmethod
    def forward(ctx, q, k, v, group, layout: Layout, causal: bool, scale: float, kernel: Kernel,
                mask: MaskSpec | None = None, grad_comm_dtype: torch.dtype = torch.float32,
                strict_block: str = "sliced", timeout=None):
        ring = Ring(group, timeout)
        n, rank, local_len = ring.world_size, ring.rank, q.size(1)
        plans = _plans(layout, mask, causal, n, rank, local_len)
        # a window that reaches back fewer ranks than the ring holds cuts the ring short
        steps = n if mask is None else layout.ring_steps(n, local_len, mask)
        fmt = "bshd" if mask is not None else kernel.tensor_format
        aligned = strict_block == "aligned"
        qn, k_cur, v_cur = (to_format(t, fmt) for t in (q, k, v))
        acc = Accumulator(qn, masked=mask is not None, fmt=fmt, value_dim=v.size(-1))
        for step in range(steps):
            transfer = ring.shift([k_cur, v_cur], f"forward step {step + 1} of {steps} (keys/values)") \
                if step < steps - 1 else None
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
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors  # [b, s, h, d]: the caller's q, k, v; out as returned
        plans, masked, scale, kernel = ctx.plans, ctx.masked, ctx.scale, ctx.kernel
        ring = Ring(ctx.group, ctx.timeout)
        n = ring.world_size
        acc = accumulator_dtype(q.dtype)  # float32; float64 for float64 inputs
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        k_cur, v_cur = k, v
        dkv_transfer = None
        steps = ctx.steps
        for step in range(steps):
            kv_transfer = ring.shift([k_cur, v_cur], f"backward step {step + 1} of {steps} (keys/values)") \
                if step < steps - 1 else None
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
                dkv_transfer = ring.shift([dk_acc.to(ctx.grad_comm_dtype), dv_acc.to(ctx.grad_comm_dtype)],
                                          f"backward step {step + 1} of {steps} (dK/dV)",
                                          hops=1 if step < steps - 1 else n - step)
                dk_acc = dv_acc = None
            if kv_transfer is not None:
                k_cur, v_cur = kv_transfer.wait()
                kv_transfer = None  # its requests hold the block sent on: free it before the next shift
        if dkv_transfer is not None:
            dk_acc, dv_acc = dkv_transfer.wait()  # our own blocks' gradients, home after n hops
        return (dq.to(q.dtype), dk_acc.to(k.dtype), dv_acc.to(v.dtype),
                None, None, None, None, None, None, None, None, None)


def _plans(layout: Layout, mask: MaskSpec | None, causal: bool, n: int, rank: int, local_len: int) -> list:
    """``plans[t]``: the kernel calls of ring step ``t`` (source ``(rank - t) % n``)."""
    if mask is not None:
        return ring_plans(layout, mask, n, rank)
    return [layout.plan(rank, (rank - t) % n, n, local_len, causal) for t in range(n)]


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} has shape {tuple(t.shape)}: expected 4 dims [batch, s_local, heads, head_dim]"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes must match, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must match in batch, s_local and kv heads, got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)} (only the head dim may differ)")
    if v.size(3) == 0:
        raise ValueError(f"v has shape {tuple(v.shape)}: its head dim must be positive")
    if q.size(0) != k.size(0):
        raise ValueError(f"batch sizes differ: q has {q.size(0)}, k and v have {k.size(0)}")
    if q.size(3) != k.size(3):
        raise ValueError(f"head_dim differs: q has {q.size(3)}, k and v have {k.size(3)}")
    if q.size(1) != k.size(1):
        raise ValueError(f"local sequence lengths differ: q has {q.size(1)}, k and v have {k.size(1)}")
    heads, kv_heads = q.size(2), k.size(2)
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"q heads ({heads}) must be a multiple of k/v heads ({kv_heads})")
    layout.check_local_len(q.size(1))


def _check_consistent_across_ranks(q, k, v, layout: Layout, causal: bool, scale: float, group,
                                   mask: MaskSpec | None, ulysses: int, kernel: Kernel, grad_comm_dtype,
                                   deterministic: bool, timeout) -> None:
    """Every rank of ``group`` passed the same signature (:func:`striped_sp.agreement.agree`: one
    small exchange the first time the group sees it, nothing afterwards); else a ``ValueError`` on
    every rank naming the field and both values."""
    fields = [
        ("q.shape", q.shape), ("k.shape", k.shape), ("v.shape", v.shape), ("dtype", q.dtype),
        ("device type", q.device.type), ("layout", layout.key), ("causal", causal), ("softmax_scale", scale),
        ("cu_seqlens", None if mask is None else mask.bounds),
        ("window_size", None if mask is None else (mask.left, mask.right)),
        ("ulysses_size", ulysses), ("backend", kernel.name), ("grad_comm_dtype", grad_comm_dtype),
        ("deterministic", deterministic),
    ]
    agree(group, fields, what="ring_attention", device=q.device, timeout=timeout, enabled=True)


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    *,
    layout: str = "striped",
    causal: bool = True,
    softmax_scale: float | None = None,
    backend: str = "auto",
    cu_seqlens: torch.Tensor | None = None,
    window_size: tuple[int, int] | None = None,
    deterministic: bool = False,
    ulysses_size: int = 1,
    ulysses_groups: tuple | None = None,
    grad_comm_dtype: torch.dtype | None = None,
    timeout: float | None = None,
    stripe_size: int | None = None,
    doc_placement=None,
) -> torch.Tensor:
    """Exact softmax attention over a sequence sharded across ``group`` in ``layout``.

    Args:
        q: ``[batch, s_local, heads, head_dim]``, this rank's queries (float16/bfloat16/float32, or
            float64: then computed in float64 throughout, for references; the math or CPU kernels).
        k, v: ``[batch, s_local, kv_heads, head_dim]``; ``heads`` a multiple of ``kv_heads``.  v may
            have its own head dim ``v_head_dim`` (multi-latent attention); a kernel that needs one
            head dim (:attr:`~striped_sp.kernels.Kernel.native_value_head_dim` false: PyTorch's
            fused ops, flash-attn 2) gets v zero-padded to q/k's at ring entry (or q and k to v's
            when v's is larger) and the output sliced back: exact, at the price of the padded
            columns travelling the ring.
        group: the context-parallel process group (default: the default group).
        layout: ``"striped"``, ``"zigzag"`` or ``"contiguous"``: how tokens were sharded
            (see :func:`striped_sp.shard`).
        causal: causal mask on *global* positions.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        backend: ``"auto"``, ``"torch"``, ``"torch_cudnn"``, ``"flash_attn"`` or ``"math"``.
        cu_seqlens: packed documents: 1-D integer boundaries ``[0, l1, l1+l2, ..., S]`` on the
            *global* row of ``S = s_local * world_size`` tokens (the THD convention), the same on
            every rank; needs ``batch == 1``.  A query attends to its own document only.  Under
            ``zigzag`` every document must be a multiple of ``2 * world_size`` long
            (:func:`striped_sp.pad_documents`).
        window_size: ``(left, right)`` sliding window (flash-attn / Megatron convention): a query at
            global position ``p`` sees keys ``p-left .. p+right``; ``-1`` = no limit; ``right`` must
            be 0 when ``causal``.  Hugging Face's ``sliding_window=W`` is ``(W - 1, 0)``.
        deterministic: bitwise-reproducible backward (Megatron's ``--deterministic-mode``): the
            ring's order is fixed; on CUDA the kernel must be flash-attn (its deterministic mode)
            or ``math``; PyTorch's fused CUDA ops are refused with a ``ValueError``.
        ulysses_size: ``u > 1`` runs hierarchical CP (:mod:`striped_sp.ulysses`): an all-to-all
            over heads inside groups of ``u`` consecutive ranks of ``group``, the ring across
            them.  The inputs stay sharded by ``shard(x, N, rank, layout)`` over the whole group.
            ``u`` must divide ``N`` and ``heads``; kv heads must divide by ``u`` or divide it.  Every
            rank must pass the same ``u``: as for shapes, ranks that disagree all raise a ``ValueError``
            (the cross-rank check below).
        ulysses_groups: ``(inner, outer)`` from :func:`striped_sp.ulysses_ring_groups` (needed
            when ``group`` is not the default group, whose groups are built on first use), or
            Megatron's hierarchical CP groups; ``outer=None`` with ``inner`` = ``group``: pure
            Ulysses.

        stripe_size, doc_placement: parameters of the striped layout (also accepted in the name,
            ``layout="striped:stripe=128,place=auto"``): tokens dealt in stripes of ``stripe_size``,
            and with ``cu_seqlens`` documents kept whole on one rank (``"auto"`` or an int, the
            longest whole document) or striped (``"split"``, the default); see
            :mod:`striped_sp.placement`.  Shard with the same parameters.
        grad_comm_dtype: the dtype dK/dV travel the ring in during backward (default float32:
            every hop adds in fp32, so the error does not grow with the ring size); bfloat16 or
            float16 halve those bytes at the cost of one rounding per hop (docs/benchmarks.md,
            section 8 has the measured error against N).
        timeout: seconds a rank waits for a ring transfer (or the ranks' agreement) before it
            raises ``TimeoutError`` naming itself, the peer and the step; default
            :func:`striped_sp.ring.ring_timeout` (``$STRIPED_SP_RING_TIMEOUT_S``, else 600).  CPU
            tensors (gloo); on CUDA the process group's own timeout applies.

    Returns:
        ``[batch, s_local, heads, v_head_dim]`` in ``q.dtype``: the rows of the full attention that
        belong to the local queries.  Differentiable in ``q``, ``k`` and ``v``.

    Every argument is checked before any message is sent; bad ones raise ``ValueError``.
    The first call with a new signature (shapes, dtype, layout, mask, window, causal, scale, Ulysses
    size, kernel, grad_comm_dtype, deterministic) also checks, with one small exchange cached
    afterwards (:mod:`striped_sp.agreement`), that every rank of the group passed the same; ranks that
    disagree all raise a ``ValueError`` naming the field.  ``STRIPED_SP_CHECK_RANKS=0`` turns it off.
    """
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "no process group initialized: call torch.distributed.init_process_group() "
                "or pass group="
            )
        group = dist.group.WORLD
    check_ranks = check_ranks_enabled()
    ring_to = ring_timeout(timeout)
    try:
        lay = get_layout(layout, stripe_size, doc_placement)
        _check_inputs(q, k, v, lay)
        call_dim = max(q.size(-1), v.size(-1))  # the kernels' head dim once padded (MLA)
        kernel = resolve_kernel(backend, q.device, q.dtype, call_dim, deterministic=bool(deterministic))
        gqa_probe_enabled()  # a bad $STRIPED_SP_GQA_NATIVE is refused here, not inside the ring
        strict_block = strict_block_mode(
            kernel, q.device, q.dtype, call_dim, applies=lay.name == "striped" and lay.dense_plans and bool(causal)
            and cu_seqlens is None and window_size is None and ulysses_size == 1 and ulysses_groups is None)
        comm = accumulator_dtype(q.dtype) if grad_comm_dtype is None else grad_comm_dtype
        if comm not in (torch.float32, torch.bfloat16, torch.float16, accumulator_dtype(q.dtype)):
            raise ValueError(f"grad_comm_dtype={grad_comm_dtype} must be torch.float32, torch.bfloat16 or torch.float16 "
                             "(or torch.float64 with float64 inputs)")
        scale = q.size(-1) ** -0.5 if softmax_scale is None else float(softmax_scale)
        if not scale > 0:
            raise ValueError(f"softmax_scale={softmax_scale} must be positive")
        if not isinstance(ulysses_size, int) or isinstance(ulysses_size, bool) or ulysses_size < 1:
            raise ValueError(f"ulysses_size={ulysses_size!r} must be a positive int")
        hierarchical = ulysses_size != 1 or ulysses_groups is not None
        if hierarchical:
            n = dist.get_world_size(group)
            if ulysses_groups is not None:
                check_ulysses_groups(group, ulysses_groups, ulysses_size)
            u = ulysses_size if ulysses_groups is None else ulysses_groups[0].size()
            check_ulysses(u, n, q.size(2), k.size(2))
            if ulysses_groups is None and n != dist.get_world_size():
                raise ValueError(
                    f"ulysses_size={u} on a group of {n} of the {dist.get_world_size()} ranks: build its "
                    "groups once on every rank with striped_sp.ulysses_ring_groups(...) and pass "
                    "ulysses_groups=(inner, outer)")
            # the ring over the inner groups runs the engine's masked plans, even for a plain mask
            mask = make_mask(q.size(1) * n, n, lay, cu_seqlens, window_size, bool(causal))
            if cu_seqlens is not None and q.size(0) != 1:
                raise ValueError(f"cu_seqlens needs batch size 1, got batch {q.size(0)}")
        else:
            mask = _make_mask(q, group, lay, bool(causal), cu_seqlens, window_size)
        if mask is not None and kernel.varlen_unavailable_reason() is not None:
            what = "hierarchical CP (ulysses_size > 1 runs the varlen plans)" if hierarchical else \
                "cu_seqlens / window_size"
            raise ValueError(f"backend {kernel.name!r} cannot run {what}: {kernel.varlen_unavailable_reason()}")
    except ValueError as e:
        # every rank learns that this one failed, instead of waiting in the ring
        agree(group, None, what="ring_attention", error=e, timeout=ring_to, enabled=check_ranks,
              device=q.device if isinstance(q, torch.Tensor) else None)
        raise
    if check_ranks:
        _check_consistent_across_ranks(q, k, v, lay, bool(causal), scale, group, mask, u if hierarchical else 1,
                                       kernel, comm, bool(deterministic), ring_to)
    value_dim = v.size(-1)
    q, k, v = _equal_head_dims(q, k, v, kernel)
    if not hierarchical:
        out = _RingAttention.apply(q, k, v, group, lay, bool(causal), scale, kernel, mask, comm, strict_block,
                                   ring_to)
        return _value_columns(out, value_dim)
    inner, outer = ulysses_groups if ulysses_groups is not None else ulysses_ring_groups(
        [dist.get_process_group_ranks(group)], u)
    if k.size(2) < u:  # one kv head per member: replicate (their gradients add back up)
        k, v = (t.repeat_interleave(u // k.size(2), dim=2) for t in (k, v))
    q2, k2, v2 = (seq_to_heads(t, inner, u) for t in (q, k, v))
    out = _RingAttention.apply(q2, k2, v2, outer, GroupedLayout(lay, u), bool(causal), scale, kernel, mask, comm,
                               strict_block, ring_to)
    return _value_columns(heads_to_seq(out, inner, u), value_dim)


def _equal_head_dims(q, k, v, kernel: Kernel):
    """q, k, v with one head dim for a kernel without :attr:`~striped_sp.kernels.Kernel.native_value_head_dim`
    (multi-latent attention): v zero-padded to q/k's head dim, or q and k to v's.  Exact: zero
    columns of q and k add nothing to a score (the scale was fixed before), and zero columns of v
    give zero output columns, which :func:`_value_columns` drops (autograd drops their gradient)."""
    d, dv = q.size(-1), v.size(-1)
    if d == dv or kernel.native_value_head_dim:
        return q, k, v
    if dv < d:
        return q, k, F.pad(v, (0, d - dv))
    return F.pad(q, (0, dv - d)), F.pad(k, (0, dv - d)), v


def _value_columns(out: torch.Tensor, value_dim: int) -> torch.Tensor:
    """``out`` without the columns of a padded v (contiguous, as the ring returns it)."""
    return out if out.size(-1) == value_dim else out[..., :value_dim].contiguous()


def _make_mask(q, group, layout: Layout, causal: bool, cu_seqlens, window_size) -> MaskSpec | None:
    """The checked mask, or ``None`` when it is the plain (causal or full) one and the layout has
    dense plans for it."""
    if cu_seqlens is None and window_size is None and layout.dense_plans:
        return None
    if cu_seqlens is not None and q.size(0) != 1:
        raise ValueError(
            f"cu_seqlens needs batch size 1 (one packed row, the THD convention), got batch {q.size(0)}: "
            "pack the rows into one, or call once per row"
        )
    n = dist.get_world_size(group)
    mask = make_mask(q.size(1) * n, n, layout, cu_seqlens, window_size, causal)
    plain = mask.bounds == (0, mask.seq_len) and mask.left == -1 and mask.right == (0 if causal else -1)
    return None if plain and layout.dense_plans else mask


def striped_attention(q, k, v, group=None, **kwargs) -> torch.Tensor:
    """:func:`ring_attention` with ``layout="striped"``."""
    if "layout" in kwargs:
        raise ValueError("striped_attention fixes layout='striped'; call ring_attention for another layout")
    return ring_attention(q, k, v, group, layout="striped", **kwargs)
