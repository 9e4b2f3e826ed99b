"""The ring request: every argument of a ring-attention call but q, k, v, checked in one place.

An adapter builds a :class:`RingRequest` once per module (layout, causal, scale, kernel backend,
window, Ulysses groups, deterministic mode, grad_comm_dtype, timeout), and once per batch the
document boundaries (:meth:`RingRequest.derive`); each call then passes only ``q``, ``k``, ``v``
(``[batch, s_local, heads, head_dim]``).  :func:`ring_attention` is the same request built for
one call.

What is checked when (every ``ValueError`` names the value and the rule):

* building: the layout, ``softmax_scale``, ``backend`` (by name), ``ulysses_size``, the window
  (flash-attn's ``window_size=(left, right)`` or transformers' ``sliding_window=W``) and the form
  of ``cu_seqlens`` (1-D integers);
* each call, before any rank sends a message: q/k/v shapes, dtypes and devices; the kernel for the
  device, dtype and head dim (cached); the mask on the global row (cached per local length); the
  Ulysses groups (once); then the cross-rank agreement (:mod:`striped_sp.engine.agreement`: one small
  exchange per new signature, nothing afterwards).  A call whose checks fail tells the group's
  other ranks before it raises.

This module holds the request, its per-call flow (checks, agreement, plan, execute), the batch's
boundary memo (:func:`batch_bounds`) and the public entry points; the checks themselves are in
:mod:`striped_sp.engine.arguments`, the head-dim and Ulysses slicing of the call's tensors in
:mod:`striped_sp.engine.call_tensors` (their names stay importable from here).
"""

from __future__ import annotations

import collections
import dataclasses

import torch
import torch.distributed as dist

from .agreement import agree, agreeing
from .arguments import (call_settings, check_flag, check_group, check_inputs, check_prepare, check_scale,
                        check_sinks, signature_fields, window_of)
from .call_tensors import equal_head_dims, ulysses_heads, value_columns
from .autograd import RingAttention
from ..kernels import BACKENDS, Kernel, accumulator_dtype, check_softcap, gqa_probe_enabled, resolve_kernel
from ..plan.layouts import Layout, get_layout
from ..plan.masks import MaskSpec, as_bounds, make_mask
from ..plan.ring_plan import HostPlan, RingPlan
from ..plan.sharded_rows import sharding_error, sharding_state
from .plans import host_plan_for, plan_for
from .transport import TorchTransport, ring_timeout
from .step import strict_block_mode
from ..plan.grouped import GroupedLayout
from .ulysses import check_ulysses, check_ulysses_groups, heads_to_seq, seq_to_heads, ulysses_ring_groups

__all__ = ["RingRequest", "ring_attention", "striped_attention", "window_of", "prepare_plans"]
# the argument checks and the call's tensor adjustments live in arguments.py and call_tensors.py; their
# names stay importable from here (callers import window_of, check_flag, check_sinks, ulysses_heads and the
# engine's in-process ring _equal_head_dims from this module)
_check_inputs, _settings, _equal_head_dims, _value_columns = check_inputs, call_settings, equal_head_dims, value_columns

_UNSET = object()
#: the boundary tensors read last, with their versions and bounds: module-level because every layer
#: of a forward passes the batch's same ``cu_seqlens`` tensor, which is read on the host (on CUDA a
#: synchronisation) once per batch instead of once per layer; holding the tensors keeps their ids
#: from being reused by another batch's meanwhile; a few entries cover the requests built ahead
_READ_BOUNDS: collections.deque = collections.deque(maxlen=4)
_DERIVED = 8  # derived requests (documents, windows) kept per request: a few batches' worth
_CALLS = 16  # checked calls (shapes, dtype, device) kept per request: the shapes of a few batches


@dataclasses.dataclass(frozen=True)
class _Call:
    """What one call runs: the checked, per-shape parts of a request."""

    kernel: Kernel
    scale: float
    mask: MaskSpec | None
    comm: torch.dtype
    strict_block: str
    ulysses: int  # 1: the plain ring


class RingRequest:
    """A ring-attention call without its tensors; ``request(q, k, v)`` runs it.

    Args as :func:`ring_attention` (all keyword-only but ``group``), plus ``sliding_window``
    (transformers' convention, instead of ``window_size``).  ``group=None``: the default group,
    looked up at the call.  Building sends nothing and raises ``ValueError`` for a bad argument;
    a request is immutable: :meth:`derive` gives one with other documents or another window.
    """

    def __init__(self, group=None, *, layout="striped", causal: bool = True, softmax_scale: float | None = None,
                 backend: str = "auto", cu_seqlens=None, window_size=None, sliding_window=None,
                 deterministic: bool = False, ulysses_size: int = 1, ulysses_groups=None,
                 grad_comm_dtype: torch.dtype | None = None, timeout: float | None = None,
                 stripe_size: int | None = None, doc_placement=None, sharded_by_documents: bool = False,
                 softcap: float | None = None):
        self.group = check_group(group)
        self.softcap = check_softcap(softcap)  # 0.0 = off
        self.layout: Layout = get_layout(layout, stripe_size, doc_placement)
        self.causal = check_flag("causal", causal)
        self.softmax_scale = check_scale(softmax_scale)
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}: expected one of {list(BACKENDS)}")
        self.backend = backend
        self.window = window_of(window_size, sliding_window, self.causal)
        self.bounds = None if cu_seqlens is None else batch_bounds(cu_seqlens)
        self.deterministic = check_flag("deterministic", deterministic)
        self.sharded_by_documents = check_flag("sharded_by_documents", sharded_by_documents)
        if not isinstance(ulysses_size, int) or isinstance(ulysses_size, bool) or ulysses_size < 1:
            raise ValueError(f"ulysses_size={ulysses_size!r} must be a positive int")
        self.ulysses_size, self.ulysses_groups = ulysses_size, ulysses_groups
        self.hierarchical = ulysses_size != 1 or ulysses_groups is not None
        self.grad_comm_dtype = grad_comm_dtype
        if timeout is not None:
            ring_timeout(timeout)  # ValueError for a bad value
        self.timeout = timeout  # resolved at each call (set_ring_timeout may change the default)
        self._calls: dict = {}  # (shapes, dtype, device) -> _Call: kernel, scale, mask, ...
        self._derived: dict = {}
        self._groups_checked = False

    def derive(self, *, cu_seqlens=_UNSET, window_size=_UNSET) -> "RingRequest":
        """This request with other document boundaries and/or another window (``None``: none);
        kept in a small cache, so a batch's documents are checked once for all its layers."""
        key = (None if cu_seqlens is _UNSET else ("cu", None if cu_seqlens is None else batch_bounds(cu_seqlens)),
               None if window_size is _UNSET else ("w", window_of(window_size, None, self.causal)))
        found = self._derived.get(key)
        if found is not None:
            return found
        new = object.__new__(RingRequest)
        new.__dict__.update(self.__dict__)
        new._calls, new._derived = {}, {}
        if key[0] is not None:
            new.bounds = key[0][1]
        if key[1] is not None:
            new.window = key[1][1]
        if len(self._derived) >= _DERIVED:
            self._derived.pop(next(iter(self._derived)))
        self._derived[key] = new
        return new

    def prepare(self, seq_len: int, *, world_size: int | None = None, rank: int | None = None) -> HostPlan:
        """Build this rank's plan for a batch of ``seq_len`` tokens (the global row) ahead of the
        model, where the batch is made: the layers then find it in the plan cache.  Checks the
        documents and window (``ValueError``); sends nothing.  ``world_size`` / ``rank``: of the
        CP group (default: this request's group)."""
        seq_len, world_size, rank = check_prepare(seq_len, world_size, rank, self._group)
        self.layout.check_seq_len(seq_len, world_size)
        local = seq_len // world_size
        mask = self._mask(local, world_size)
        if not self.hierarchical:
            return host_plan_for(self.layout, mask, self.causal, world_size, rank, local)
        u = self.ulysses_size if self.ulysses_groups is None else self.ulysses_groups[0].size()
        return host_plan_for(GroupedLayout(self.layout, u), mask, self.causal, world_size // u, rank // u, local * u)

    def _group(self):
        if self.group is not None:
            return self.group
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("no process group initialized: call torch.distributed.init_process_group() "
                             "or pass group=")
        return dist.group.WORLD

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
        """``[batch, s_local, heads, v_head_dim]`` in ``q.dtype`` (see :func:`ring_attention`, also
        for ``sinks``)."""
        group = self._group()
        check_ranks, timeout, setting_error = call_settings(self.timeout)
        device = q.device if isinstance(q, torch.Tensor) else None
        with agreeing(group, device=device, timeout=timeout, enabled=check_ranks):
            if setting_error is not None:
                raise setting_error
            call = self._prepare(q, k, v, group)
            check_sinks(sinks, q)
            n = dist.get_world_size(group)
            sharded = sharding_state(self.layout, q.size(1) * n, n, self.bounds, self.sharded_by_documents)
        if check_ranks:
            self._agree(q, k, v, group, call, timeout, sharded, sinks is not None)
        if sharded is False:  # the same on every rank once they agreed: all raise, before the ring's first message
            raise ValueError(sharding_error("ring_attention", self.layout, q.size(1) * n, n, self.bounds))
        value_dim = v.size(-1)
        q, k, v = equal_head_dims(q, k, v, call.kernel)
        if call.ulysses == 1 and not self.hierarchical:
            transport = TorchTransport(group, timeout)
            plan = self._plan(self.layout, call, transport, q, v)
            return value_columns(RingAttention.apply(q, k, v, plan, transport, sinks), value_dim)
        u = call.ulysses
        inner, outer = self.ulysses_groups if self.ulysses_groups is not None else ulysses_ring_groups(
            [dist.get_process_group_ranks(group)], u)
        if sinks is not None:  # this member's heads after the all-to-all: slice i of u (engine/ulysses.py)
            sinks = ulysses_heads(sinks, dist.get_rank(inner), u)
        if k.size(2) < u:  # one kv head per member: replicate (their gradients add back up)
            k, v = (t.repeat_interleave(u // k.size(2), dim=2) for t in (k, v))
        q2, k2, v2 = (seq_to_heads(t, inner, u) for t in (q, k, v))
        transport = TorchTransport(outer, timeout)
        plan = self._plan(GroupedLayout(self.layout, u), call, transport, q2, v2)
        out = RingAttention.apply(q2, k2, v2, plan, transport, sinks)
        return value_columns(heads_to_seq(out, inner, u), value_dim)

    def _plan(self, layout, call: _Call, transport, q, v) -> RingPlan:
        """The batch's plan for this rank, from the plan cache (built on the first layer that asks)."""
        return plan_for(layout, call.mask, self.causal, transport.world_size, transport.rank, q.size(1),
                        kernel=call.kernel, scale=call.scale, comm_dtype=call.comm, strict_block=call.strict_block,
                        device=q.device, dtype=q.dtype, head_dim=max(q.size(-1), v.size(-1)), batch=q.size(0),
                        heads=q.size(2))

    def _prepare(self, q, k, v, group, *, world_size: int | None = None, kernel: Kernel | None = None) -> _Call:
        """Every check of one call (nothing sent); the shape-dependent results cached.  ``group=None``
        with ``world_size`` (and optionally a ``kernel`` instead of the backend's): the checks of a ring
        of that size without a process group (the in-process executor, :mod:`striped_sp.engine.local`)."""
        check_inputs(q, k, v, self.layout)
        if self.bounds is not None and q.size(0) != 1:
            raise ValueError(
                f"cu_seqlens needs batch size 1 (one packed row, the THD convention), got batch {q.size(0)}: "
                "pack the rows into one, or call once per row")
        key = (q.shape, k.shape, v.shape, q.dtype, q.device)
        call = self._calls.pop(key, None)  # re-inserted below: the least recently used goes first
        if call is not None:
            self._calls[key] = call
        else:
            if len(self._calls) >= _CALLS:  # rows of many lengths (variable-length batches): the oldest goes
                self._calls.pop(next(iter(self._calls)))
            call = self._calls[key] = self._build_call(q, k, v, group, world_size, kernel)
        gqa_probe_enabled()  # a bad $STRIPED_SP_GQA_NATIVE is refused here, not inside the ring
        # the environment may change between calls: the strict block form is read each time
        strict = strict_block_mode(call.kernel, q.device, q.dtype, max(q.size(-1), v.size(-1)), applies=(
            self.layout.strict_block and self.causal and call.mask is None and not self.hierarchical))
        return call if strict == call.strict_block else dataclasses.replace(call, strict_block=strict)

    def _build_call(self, q, k, v, group, world_size: int | None = None, kernel: Kernel | None = None) -> _Call:
        comm = accumulator_dtype(q.dtype) if self.grad_comm_dtype is None else self.grad_comm_dtype
        if comm not in (torch.float32, torch.bfloat16, torch.float16, accumulator_dtype(q.dtype)):
            raise ValueError(f"grad_comm_dtype={self.grad_comm_dtype} must be torch.float32, torch.bfloat16 or "
                             "torch.float16 (or torch.float64 with float64 inputs)")
        scale = q.size(-1) ** -0.5 if self.softmax_scale is None else self.softmax_scale
        n = dist.get_world_size(group) if group is not None else world_size
        u = 1
        if self.hierarchical and group is None:
            u = self.ulysses_size
            check_ulysses(u, n, q.size(2), k.size(2))
        elif self.hierarchical:
            if self.ulysses_groups is not None and not self._groups_checked:
                check_ulysses_groups(group, self.ulysses_groups, self.ulysses_size)
                self._groups_checked = True
            u = self.ulysses_size if self.ulysses_groups is None else self.ulysses_groups[0].size()
            check_ulysses(u, n, q.size(2), k.size(2))
            if self.ulysses_groups is None and n != dist.get_world_size():
                raise ValueError(
                    f"ulysses_size={u} on a group of {n} of the {dist.get_world_size()} ranks: build its "
                    "groups once on every rank with striped_sp.ulysses_ring_groups(...) and pass "
                    "ulysses_groups=(inner, outer)")
        mask = self._mask(q.size(1), n)
        if kernel is None:  # by (d, dv): a kernel with MLA shapes of its own (FA4's (192, 128)) is judged on them
            dims = q.size(-1) if q.size(-1) == v.size(-1) else (q.size(-1), v.size(-1))
            kernel = resolve_kernel(self.backend, q.device, q.dtype, dims, deterministic=self.deterministic,
                                    varlen=mask is not None, gqa=k.size(2) != q.size(2), softcap=self.softcap)
        else:
            kernel = kernel.with_softcap(self.softcap)
        if mask is not None and kernel.varlen_unavailable_reason() is not None:
            what = "cu_seqlens / window_size" + (" under hierarchical CP" if self.hierarchical else "")
            raise ValueError(f"backend {kernel.name!r} cannot run {what}: {kernel.varlen_unavailable_reason()}")
        return _Call(kernel, scale, mask, comm, "sliced", u)

    def _mask(self, local_len: int, n: int) -> MaskSpec | None:
        """The checked mask of the global row, or ``None`` when it is the plain (causal or full) one
        and the layout has dense plans for it (the hierarchical ring's too: plan/grouped.py)."""
        if self.bounds is None and self.window is None and self.layout.dense_plans:
            return None
        mask = make_mask(local_len * n, n, self.layout, self.bounds, self.window, self.causal)
        plain = mask.bounds == (0, mask.seq_len) and mask.left == -1 and mask.right == (0 if self.causal else -1)
        # a layout whose stripes depend on the row (a window hint) runs the dense plans where they are 1
        return None if plain and self.layout.dense_row(local_len * n, n) else mask

    def _agree(self, q, k, v, group, call: _Call, timeout, sharded: bool | None = None, sinks: bool = False) -> None:
        """Every rank of ``group`` passed the same signature (:func:`striped_sp.engine.agreement.agree`: one
        small exchange the first time the group sees it, nothing afterwards); else a ``ValueError`` on
        every rank naming the field and both values."""
        agree(group, signature_fields(self, q, k, v, call, sharded, sinks), what="ring_attention", device=q.device, timeout=timeout, enabled=True)


def batch_bounds(cu_seqlens) -> tuple[int, ...]:
    """``cu_seqlens`` as a tuple of ints (:func:`~striped_sp.plan.masks.as_bounds`); a tensor is read
    on the host once per batch: the same tensor object, unmodified since (its ``_version``), is
    not read again by the next layers (an inference-mode tensor, which has no version, and a
    list are read every time)."""
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.is_inference():  # lists: no version to see a change
        return as_bounds(cu_seqlens)
    for seen, version, bounds in _READ_BOUNDS:
        if seen is cu_seqlens and seen._version == version:
            return bounds
    bounds = as_bounds(cu_seqlens)
    _READ_BOUNDS.append((cu_seqlens, cu_seqlens._version, bounds))
    return bounds


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
    sharded_by_documents: bool = False,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
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
            (:func:`striped_sp.pad_documents`).  Where the layout places a packed row's tokens by its
            documents (the default ``striped``'s search, ``zigzag``, per-document stripes, whole-document
            placement), shard q, k, v with the same ``cu_seqlens`` (``striped_sp.shard(t, n, rank,
            layout=..., cu_seqlens=cu)``): a row no such ``shard`` call of this process sharded is refused
            with a ``ValueError`` on every rank before the ring starts (a dense shard holds other tokens).
        sharded_by_documents: the inputs were sharded with ``cu_seqlens`` by other means (a
            ``DataLoader`` worker, the index of :func:`striped_sp.positions` with ``cu_seqlens``): skip
            the check above.
        window_size: ``(left, right)`` sliding window (flash-attn / Megatron convention): a query at
            global position ``p`` sees keys ``p-left .. p+right``; ``-1`` = no limit; ``right`` must
            be 0 when ``causal``.  Hugging Face's ``sliding_window=W`` is ``(W - 1, 0)``.
        deterministic: bitwise-reproducible backward (Megatron's ``--deterministic-mode``): the
            ring's order is fixed; on CUDA the kernel must be flash-attn (its deterministic mode)
            or ``math``; PyTorch's fused CUDA ops are refused with a ``ValueError``.
        ulysses_size: ``u > 1`` runs hierarchical CP (:mod:`striped_sp.engine.ulysses`): an all-to-all
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
            :mod:`striped_sp.plan.placement`.  Shard with the same parameters.
        grad_comm_dtype: the dtype dK/dV travel the ring in during backward (default float32:
            every hop adds in fp32, so the error does not grow with the ring size); bfloat16 or
            float16 halve those bytes at the cost of one rounding per hop (docs/tuning.md,
            "dK/dV precision on the ring" has the measured error against N).
        sinks: attention sinks (gpt-oss' ``sinks``, Megatron's ``softmax_offset``): ``[heads]``, one
            logit per query head (all of q's heads: under Ulysses each member takes its slice),
            any floating dtype (the one the model keeps them in), on q's device.  Each row's
            softmax gets one more term ``exp(s_h)`` with no value; folded into the merged lse once
            after the ring, in float32 (float64 for float64 inputs).  Differentiable: the gradient
            is this rank's rows' part, in ``sinks.dtype``; the framework's gradient reduction over
            the context-parallel ranks (as for every replicated weight) sums it.  ``None``: none.
        softcap: logit soft-capping (Gemma 2's ``attn_logit_softcapping``): every score ``s``
            becomes ``c * tanh(s / c)`` before the softmax, inside the kernel (forward and backward);
            ``None`` or 0: off, else a positive finite float.  Only kernels that soft-cap run it
            (``math``, ``flash_attn``, ``fa4``): ``auto`` picks one; a named one that cannot raises.
        timeout: seconds a rank waits for a ring transfer (or the ranks' agreement) before it
            raises ``TimeoutError`` naming itself, the peer and the step; default
            :func:`striped_sp.engine.transport.ring_timeout` (``$STRIPED_SP_RING_TIMEOUT_S``, else 600).  CPU
            tensors (gloo); on CUDA the process group's own timeout applies.

    Returns:
        ``[batch, s_local, heads, v_head_dim]`` in ``q.dtype``: the rows of the full attention that
        belong to the local queries.  Differentiable in ``q``, ``k`` and ``v``.

    Every argument is checked before any message is sent; bad ones raise ``ValueError``.
    The first call with a new signature (shapes, dtype, layout, mask, window, causal, scale, Ulysses
    size, kernel, grad_comm_dtype, deterministic) also checks, with one small exchange cached
    afterwards (:mod:`striped_sp.engine.agreement`), that every rank of the group passed the same; ranks that
    disagree all raise a ``ValueError`` naming the field.  ``STRIPED_SP_CHECK_RANKS=0`` turns it off.
    """
    if check_group(group) is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "no process group initialized: call torch.distributed.init_process_group() "
                "or pass group="
            )
        group = dist.group.WORLD
    check_ranks, ring_to, setting_error = call_settings(timeout)
    with agreeing(group, device=q.device if isinstance(q, torch.Tensor) else None, timeout=ring_to,
                  enabled=check_ranks):
        if setting_error is not None:
            raise setting_error
        request = RingRequest(group, layout=layout, causal=causal, softmax_scale=softmax_scale, backend=backend,
                              cu_seqlens=cu_seqlens, window_size=window_size, deterministic=deterministic,
                              ulysses_size=ulysses_size, ulysses_groups=ulysses_groups,
                              grad_comm_dtype=grad_comm_dtype, timeout=timeout, stripe_size=stripe_size,
                              doc_placement=doc_placement, sharded_by_documents=sharded_by_documents,
                              softcap=softcap)
    return request(q, k, v, sinks=sinks)


def prepare_plans(seq_len: int, group=None, *, world_size: int | None = None, rank: int | None = None,
                  **request_args) -> HostPlan:
    """Build this rank's plan for one batch ahead of the model (in ``get_batch``, the loader or the
    collator): ``seq_len`` tokens on the global row, ``request_args`` as :func:`ring_attention`
    (``layout``, ``causal``, ``cu_seqlens``, ``window_size``, ``ulysses_size``, ...).  Every layer
    with those settings then runs the plan from the cache with no planning.  Sends nothing."""
    return RingRequest(group, **request_args).prepare(seq_len, world_size=world_size, rank=rank)


def striped_attention(q, k, v, group=None, **kwargs) -> torch.Tensor:
    """:func:`ring_attention` with ``layout="striped"``."""
    if "layout" in kwargs:
        raise ValueError("striped_attention fixes layout='striped'; call ring_attention for another layout")
    return ring_attention(q, k, v, group, layout="striped", **kwargs)
