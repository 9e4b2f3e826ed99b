"""The softmax merge: fold one block's ``(out, lse)`` into running fp32 accumulators, in place;
and attention sinks, the one place that knows them (:func:`fold_sinks`, :func:`sink_grad`).

A sink is one more logit ``s_h`` per (head, query row) with no value (gpt-oss, Megatron's
``--softmax-type learnable``): it only enlarges the softmax denominator.  It is folded into the
merged lse once, after the ring's last step (``lse' = logaddexp(lse, s_h)``, ``out' = out *
exp(lse - lse')``); the backward runs the kernels unchanged with ``lse'`` and ``out'`` (their
``rowsum(dout * out')`` is the sink softmax's too, the sink contributing no value) and
``d s_h = -sum_rows exp(s_h - lse') * rowsum(dout * out')``.  No kernel knows about sinks.

Formats as in :mod:`striped_sp.engine.step`: ``"bshd"`` (``[b, s, h, d]``) or ``"bhsd"``; log-sum-exps
are ``[b, h, s]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["merge_block", "merge_block_safe", "merge_rows", "fold_sinks", "sink_grad"]


def _lse_weight(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """``[b, h, s]`` per-row weights, broadcastable against an output in ``fmt``."""
    return (w.transpose(1, 2) if fmt == "bshd" else w).unsqueeze(-1)


_NEG_INF = float("-inf")


def _seen_nothing_as_neg_inf(block_lse: torch.Tensor) -> torch.Tensor:
    """A block's lse with every row that saw no key at ``-inf`` (weight 0 in the merge): kernels
    report such a row as ``+inf`` (flash-attn 2, PyTorch's flash op) or ``-inf`` (FA3, FA4), and a
    NaN is no weight either.  (The memory-efficient op reports 0, which no merge can tell from a
    real lse: the ring never gives that op a row without keys, see TorchKernel.)"""
    return block_lse.nan_to_num(nan=_NEG_INF, posinf=_NEG_INF, neginf=_NEG_INF)


def merge_block(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor,
                fmt: str = "bshd") -> None:
    """Fold one block's result into the running accumulators, in place.

    ``out``: float32 in ``fmt``; ``lse``: float32 ``[b, h, s]`` (views of the accumulators for the
    block's query rows; float64 both for float64 inputs); ``block_out`` in ``fmt``, any float dtype
    (0 in a row that saw no key); ``block_lse`` ``[b, h, s]``, taken in ``lse``'s dtype, ``+inf``,
    ``-inf`` or NaN where the row saw no key (it leaves the accumulators as they are).  Uses the sigmoid form of the softmax merge, which never subtracts two large
    exponents: ``out += sigmoid(lse_b - lse) * (out_b - out)``, ``lse -= logsigmoid(lse - lse_b)``.
    """
    # the accumulators' dtype decides (a float64 kernel into fp32 ones); a row that saw no key weighs 0
    block_lse = _seen_nothing_as_neg_inf(block_lse.to(lse.dtype))
    weight = _lse_weight(torch.sigmoid(block_lse - lse), fmt)
    out.lerp_(block_out.to(out.dtype), weight)  # one pass, no temporaries
    lse.sub_(F.logsigmoid(lse - block_lse))


def merge_block_safe(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor,
                     fmt: str = "bshd") -> None:
    """:func:`merge_block` for accumulators that may still hold rows with ``lse = -inf`` (no key
    seen yet, under a document or window mask): the new lse is a ``logaddexp``."""
    block_lse = _seen_nothing_as_neg_inf(block_lse.to(lse.dtype))
    # both -inf (no key in the block nor before): sigmoid(nan), taken as weight 0
    weight = _lse_weight(torch.sigmoid(block_lse - lse).nan_to_num_(0.0), fmt)
    out.lerp_(block_out.to(out.dtype), weight)
    torch.logaddexp(lse, block_lse, out=lse)


def merge_rows(acc_out, acc_lse, rows: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge ``out`` ``[b, R, h, d]`` / ``lse`` ``[b, h, R]`` into accumulator rows ``rows`` (distinct)."""
    cur, cur_lse = acc_out.index_select(1, rows), acc_lse.index_select(2, rows)
    merge_block_safe(cur, cur_lse, out, lse)
    acc_out.index_copy_(1, rows, cur)
    acc_lse.index_copy_(2, rows, cur_lse)


def fold_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor, fmt: str = "bshd") -> None:
    """Fold sink logits ``sinks`` ``[h]`` (any float dtype, taken in ``lse``'s) into the final
    accumulators, in place: ``lse = logaddexp(lse, s_h)``, ``out *= exp(lse_old - lse)``.  Once per
    row, after the ring's last step (a sink folded per step would count once per step).  A row
    that saw no key (``lse = -inf``) comes out ``0`` with ``lse = s_h``: the sink takes all of its
    softmax, and no NaN."""
    sink = sinks.to(lse.dtype).view(1, -1, 1)
    new = torch.logaddexp(lse, sink)
    unseen = lse == _NEG_INF
    out.mul_(_lse_weight(torch.exp(lse - new), fmt))
    out.masked_fill_(_lse_weight(unseen, fmt), 0.0)  # a -inf sink too: exp(nan) there
    lse.copy_(new)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The gradient of the sink logits ``[h]`` from this rank's rows, in ``lse``'s dtype (float32;
    float64 for float64 inputs): ``-sum_{b, rows} exp(s_h - lse') * rowsum(dout * out')``.
    ``dout``/``out`` ``[b, s, h, dv]`` (``out`` the folded output as the forward returned it, the one
    the kernels' backward reads), ``lse`` ``[b, h, s]`` the folded lse; rows in one order."""
    acc = lse.dtype
    rowsum = torch.einsum("bshd,bshd->bhs", dout.to(acc), out.to(acc))
    weight = torch.exp(sinks.to(acc).view(1, -1, 1) - lse).nan_to_num_(0.0)  # a -inf sink on an unseen row
    return -(weight * rowsum).sum((0, 2))
