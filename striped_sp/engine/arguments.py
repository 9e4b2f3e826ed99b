"""The checks of a ring-attention call's arguments, each in one function (every error names the value
and the rule): the window (either convention), the process group, bool flags, the softmax scale,
the attention sinks, q/k/v (``[batch, s_local, heads, head_dim]``), the per-call settings read from
the environment (rank check, ring timeout), and the fields every rank must agree on.

:class:`~striped_sp.engine.request.RingRequest` runs them when it is built and at each call; they
send nothing.
"""

from __future__ import annotations

import datetime
import math
import numbers

import torch
import torch.distributed as dist

from .agreement import check_ranks_enabled
from ..plan.layouts import Layout
from ..plan.masks import check_window
from .transport import DEFAULT_TIMEOUT_S, ring_timeout

__all__ = ["window_of", "check_group", "check_flag", "check_scale", "check_sinks", "check_inputs", "call_settings",
           "check_prepare", "signature_fields"]


def window_of(window_size=None, sliding_window=None, causal: bool = True):
    """The one window of a call, from either convention: ``window_size=(left, right)`` (flash-attn,
    ``-1`` = no limit) or transformers' ``sliding_window=W`` (a query sees itself and the ``W - 1``
    keys before it: ``(W - 1, 0)``); ``None`` without one.  ``ValueError`` naming the value."""
    if window_size is not None and sliding_window is not None:
        raise ValueError(f"give window_size={window_size!r} or sliding_window={sliding_window!r}, not both")
    if sliding_window is not None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, numbers.Integral) or sliding_window < 1:
            raise ValueError(f"sliding_window={sliding_window!r} must be a positive int (a query sees itself and "
                             "the sliding_window - 1 keys before it)")
        if not causal:
            raise ValueError(f"sliding_window={sliding_window} on a non-causal attention layer: the ring engine "
                             "runs transformers' sliding windows for causal layers only (give window_size=(left, right))")
        return (int(sliding_window) - 1, 0)
    if window_size is None:
        return None
    return check_window(window_size, causal)


def check_group(group):
    """``group`` unless it is neither ``None`` nor a process group (``TypeError`` naming it)."""
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group={group!r} must be a torch.distributed ProcessGroup or None (the default group), "
                        f"got {type(group).__name__}")
    return group


def check_flag(name: str, value) -> bool:
    """A bool argument (``causal``, ``deterministic``): a Python or NumPy bool, or the int 0 / 1;
    anything else (a string such as ``"False"``, which ``bool()`` reads as true) is a ``TypeError``."""
    kind = type(value)
    if isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool", "bool_")):
        return bool(value)  # NumPy 2 names its bool scalar type "bool", NumPy 1 "bool_"
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    where = "" if kind.__module__ == "builtins" else kind.__module__.split(".")[0] + "."
    raise TypeError(f"{name}={value!r} must be a bool, got {where}{kind.__name__}")


def check_scale(softmax_scale) -> float | None:
    """``softmax_scale`` as a float, ``None`` kept (head_dim ** -0.5 at the call): a finite real > 0."""
    if softmax_scale is None:
        return None
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, numbers.Real):
        raise TypeError(f"softmax_scale={softmax_scale!r} must be a real number (a finite float > 0) or None, "
                        f"got {type(softmax_scale).__name__}")
    value = float(softmax_scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softmax_scale={softmax_scale!r} must be positive and finite (a number > 0)")
    return value


def check_sinks(sinks, q: torch.Tensor) -> None:
    """``sinks`` is ``None`` or a floating-point ``[heads]`` tensor on q's device (``heads`` = q's,
    every query head of the call, before any Ulysses split); else ``ValueError`` naming its shape
    and the rule."""
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor):
        raise ValueError(f"sinks must be a torch.Tensor of shape [heads] (one sink logit per query head) or None, "
                         f"got {type(sinks).__name__}")
    heads = q.size(2)
    if sinks.dim() != 1 or sinks.size(0) != heads:
        raise ValueError(f"sinks has shape {tuple(sinks.shape)}: expected [{heads}], 1-D with one sink logit per "
                         f"query head (q has {heads} heads; every head of the call, before any Ulysses split)")
    if not sinks.is_floating_point():
        raise ValueError(f"sinks has dtype {sinks.dtype}: expected a floating-point dtype (the model's own; "
                         "folded in float32)")
    if sinks.device != q.device:
        raise ValueError(f"sinks is on {sinks.device}, q on {q.device}: they must be on one device")


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout) -> None:
    """q, k, v of one call: 4-D ``[batch, s_local, heads, head_dim]`` tensors (v may have its own head dim)
    of one dtype and device, every dim positive, ``heads`` a multiple of ``kv_heads``, ``s_local`` a
    length the layout takes; else ``ValueError`` naming the tensor and the rule."""
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
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.size(1) == 0:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: an empty local sequence (s_local = 0): the local "
                             "sequence length must be positive (the global row of S tokens, S / N per rank)")
        if min(t.shape) == 0:
            raise ValueError(f"{name} has shape {tuple(t.shape)}: every dim (batch, s_local, heads, head_dim) "
                             "must be positive")
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


def call_settings(timeout) -> tuple[bool, datetime.timedelta, Exception | None]:
    """The check setting and the ring timeout of a call, and the error of a bad one: raised inside the
    agreement, so that the peers hear of it instead of waiting (a bad one reads as the default: the
    check on, the default timeout)."""
    error = None
    try:
        check_ranks = check_ranks_enabled()
    except ValueError as err:
        check_ranks, error = True, err
    try:
        ring_to = ring_timeout(timeout)
    except ValueError as err:
        ring_to, error = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S), error or err
    return check_ranks, ring_to, error


def check_prepare(seq_len, world_size, rank, group_of) -> tuple[int, int, int]:
    """``(seq_len, world_size, rank)`` of :meth:`~striped_sp.engine.request.RingRequest.prepare` as ints:
    ``seq_len`` an int (``TypeError``), ``world_size`` and ``rank`` both given or neither (then those of
    the process group ``group_of()`` returns), ``world_size >= 1`` and ``0 <= rank < world_size``
    (``ValueError``)."""
    if isinstance(seq_len, bool) or not isinstance(seq_len, numbers.Integral):
        raise TypeError(f"prepare: seq_len={seq_len!r} must be an int (the tokens of the global row), "
                        f"got {type(seq_len).__name__}")
    seq_len = int(seq_len)
    if (world_size is None) != (rank is None):
        raise ValueError(f"prepare: world_size={world_size!r} and rank={rank!r}: give both (the CP group's size "
                         "and this rank in it) or neither (then the request's group says)")
    if world_size is None:
        group = group_of()
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    for name, value, low in (("world_size", world_size, 1), ("rank", rank, 0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"prepare: {name}={value!r} must be an int >= {low}")
    if rank >= world_size:
        raise ValueError(f"prepare: rank={rank} must be below world_size={world_size}")
    return seq_len, world_size, rank


def signature_fields(request, q, k, v, call, sharded: bool | None, sinks: bool) -> list[tuple[str, object]]:
    """``(name, value)`` of everything every rank of the group must pass the same for one call of
    ``request`` (:func:`striped_sp.engine.agreement.agree` compares them): shapes, dtype, device type,
    layout, causal, scale, documents and window, Ulysses size, kernel, ``grad_comm_dtype``,
    deterministic, whether the row was sharded by its documents, sinks, soft-capping."""
    mask = call.mask
    return [
        ("q.shape", q.shape), ("k.shape", k.shape), ("v.shape", v.shape), ("dtype", q.dtype),
        ("device type", q.device.type), ("layout", request.layout.key), ("causal", request.causal),
        ("softmax_scale", call.scale),
        ("cu_seqlens", None if mask is None else mask.bounds),
        ("window_size", None if mask is None else (mask.left, mask.right)),
        ("ulysses_size", call.ulysses), ("backend", call.kernel.name), ("grad_comm_dtype", call.comm),
        ("deterministic", request.deterministic),
        ("sharded by documents", sharded),  # None where the documents move no token
        ("sinks", sinks), ("softcap", request.softcap),
    ]
