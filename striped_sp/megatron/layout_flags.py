"""The striped layout's Megatron flags: ``--striped-stripe-size`` (an int, ``doc`` or ``auto``),
``--striped-doc-placement`` and ``--striped-order``, read from Megatron's ``args`` with errors that
name the flag."""

from __future__ import annotations

import argparse

from ..plan.mirror import ORDERS
from ..plan.placement import check_placement, check_stripe_size

__all__ = ["stripe_arg", "stripe_size_of", "doc_placement_of", "order_of"]


def stripe_arg(text: str) -> int | str:
    """``--striped-stripe-size``: an int, ``doc`` or ``auto``."""
    if text.strip() in ("doc", "auto"):
        return text.strip()
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected an integer, 'doc' or 'auto'") from None


def stripe_size_of(args) -> int | str:
    """The stripe size of ``args.striped_stripe_size`` (``auto`` resolved for this model); not given
    (``None``): ``auto`` under ``--context-parallel-algo striped`` without ``--striped-doc-placement``
    (the default, as the core's ``layout="striped"``), else 1 (a placement alone keeps stripes of 1)."""
    value = _stripe_value(args)
    if value == "auto":
        return _auto_stripe(args)[0]
    try:
        return check_stripe_size(value)
    except ValueError:
        raise ValueError(f"--striped-stripe-size {value!r} must be a positive integer (1: token by token) or "
                         "doc (per document: 2 * CP stripes dealt to ranks 0..CP-1, then back) or auto") from None


def _stripe_value(args) -> int | str:
    """``args.striped_stripe_size`` as given (digits as an int), its default resolved (``None``:
    ``auto`` under ``--context-parallel-algo striped`` without a placement, else 1)."""
    value = getattr(args, "striped_stripe_size", None)
    if value is None:
        striped = str(getattr(args, "context_parallel_algo", "")).partition(":")[0] == "striped"
        value = "auto" if striped and getattr(args, "striped_doc_placement", None) in (None, "split") else 1
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    return value


def _auto_stripe(args) -> tuple:
    """``--striped-stripe-size auto``: ``(stripe size, order or None)`` for this model's rows (``--sft``:
    packed) and its window layers (``--window-size``, with ``--window-attn-skip-freq`` choosing the
    full-attention layers, as megatron-core counts them): on rows of one document with window layers the
    placement the cost model predicts fastest for those layers
    (:func:`~striped_sp.plan.window_choice.window_choice`; zigzag's order as ``S / 2N`` stripes dealt
    mirrored, ``"mirror"``), else :func:`striped_sp.plan.stripe_choice.choose_stripe_size`."""
    from ..plan.stripe_choice import choose_stripe_size

    window = getattr(args, "window_size", None)
    left = int(window[0]) if window is not None else -1
    layers = int(getattr(args, "num_layers", None) or 1)
    skip = getattr(args, "window_attn_skip_freq", None)
    if left < 0:
        windowed = 0
    elif skip is None:
        windowed = layers
    elif isinstance(skip, int):
        windowed = sum(1 for n in range(1, layers + 1) if n % skip != 0)
    else:
        windowed = sum(1 for flag in list(skip)[:layers] if flag)
    cp = int(getattr(args, "context_parallel_size", 1) or 1)
    seq = int(getattr(args, "seq_length", None) or cp)
    sft = bool(getattr(args, "sft", False))
    if not sft and 0 <= left < seq and windowed and cp > 1 and seq % cp == 0:
        from ..plan.layouts import Striped
        from ..plan.window_choice import window_choice

        stripe = window_choice(seq, cp, left, windowed, layers - windowed, striped=Striped)[0]
        return (seq // (2 * cp), "mirror") if stripe == "doc" else (stripe, "round")
    return choose_stripe_size(seq, cp, sft, left if left >= 0 else None, windowed, layers - windowed), None


def order_of(args) -> str | None:
    """The dealing order of ``args.striped_order`` (``round`` or ``mirror``); not given (``None``): the
    one ``--striped-stripe-size auto`` resolved for this model's window layers (``"round"`` where it
    chose stripes of 1, pinned, ``"mirror"`` for zigzag's order), else ``None``."""
    value = getattr(args, "striped_order", None)
    if value is None:
        return _auto_stripe(args)[1] if _stripe_value(args) == "auto" else None
    if value not in ORDERS:
        raise ValueError(f"--striped-order {value!r} must be round (stripe g to rank g mod CP, the paper's) or "
                         "mirror (ranks 0..CP-1 then CP-1..0: zigzag's order; with --striped-stripe-size "
                         "seq-length / (2 * CP) zigzag's own placement)")
    if value == "mirror" and not isinstance(_stripe_value(args), int):
        raise ValueError(f"--striped-order mirror deals stripes of an integer --striped-stripe-size, got "
                         f"{_stripe_value(args)!r}: give one (seq-length / (2 * CP) is zigzag's placement), or drop "
                         "--striped-order and let the default choose (it takes zigzag's order where the cost model "
                         "predicts it faster)")
    return value


def doc_placement_of(args):
    """The placement of ``args.striped_doc_placement``: ``"split"``, ``"auto"`` or an int."""
    value = getattr(args, "striped_doc_placement", "split")
    value = "split" if value is None else value
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    try:
        return check_placement(value)
    except ValueError:
        raise ValueError(
            f"--striped-doc-placement {value!r} must be split, auto or a positive integer (the longest "
            "document kept whole on one rank)") from None
