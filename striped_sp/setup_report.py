"""The one line an adapter logs on global rank 0 when it sets striped_sp up: that it is on, and how.

``setup_line`` gives: the layout (algo), the CP size and groups, the kernel and why, the stripe
policy, and the cost model the ``auto`` choices and plans use (a calibration, or the table's).
The Megatron adapter logs it with Python logging (``striped_sp.megatron``, INFO, as megatron-core's
``log_single_rank``; Megatron-LM's training sets the root logger to INFO), the DeepSpeed adapter with
the ``striped_sp.deepspeed`` logger at INFO, shown by default on rank 0 (:mod:`striped_sp.deepspeed.report`).  Nothing here communicates.
"""

from __future__ import annotations

import torch

from .kernels import KERNELS, available_backends, resolve_kernel
from .plan import cost
from .plan.layouts import get_layout

__all__ = ["stripe_policy", "kernel_choice", "cost_model_state", "setup_line"]


def stripe_policy(layout_key: str) -> str:
    """What the layout ``layout_key`` deals to each rank, in words (``auto`` spelled out)."""
    layout = get_layout(layout_key)
    stripe = getattr(layout, "stripe_size", None)
    if stripe is None:
        return {"zigzag": "zigzag chunks r and 2N-1-r", "contiguous": "contiguous chunks"}.get(layout.name, layout.name)
    if stripe == "auto":
        policy = ("stripe size auto: per packed batch, the stripe size, per-document stripes or whole-document "
                  "placement the cost model predicts fastest (plan.search); rows "
                  "of one document token by token")
        if layout.window is not None:  # the window hint (a model with sliding-window layers)
            every = "every layer" if layout.global_every is None else f"one global layer in {layout.global_every}"
            policy = policy.replace("token by token", f"in stripes of about W / 4 (the window hint W = {layout.window}, "
                                    f"{every}; 1 where window layers hold under 20% of the entries or no stripe of 64 or more "
                                    "divides the tokens per rank); from 4 ranks on, packed rows in stripes of about W / 8 instead")
    elif stripe == "doc":
        policy = "per-document stripes: 2N per document, dealt to ranks 0..N-1 and back"
    elif stripe == 1:
        policy = "stripe size 1 (token by token)"
    else:
        policy = f"stripes of {stripe} tokens"
    if getattr(layout, "default", False) or layout.key.startswith("striped:window="):  # no stripe size given
        policy = "no stripe size given, so " + policy
    place = getattr(layout, "doc_placement", "split")
    if place == "auto" and stripe != "auto":
        policy += "; documents up to a length the cost model picks kept whole on one rank"
    elif isinstance(place, int):
        policy += f"; documents of at most {place} tokens kept whole on one rank"
    return policy


def kernel_choice(backend: str, device: torch.device, dtype: torch.dtype, head_dim=None,
                  gqa: bool | None = None, softcap: float = 0.0) -> tuple[str, str]:
    """``(kernel name, why)`` for ``backend`` on ``device`` / ``dtype`` / ``head_dim`` (``gqa``:
    whether the model has fewer kv heads than query heads, ``None``: unknown): the kernel
    :func:`striped_sp.kernels.resolve_kernel` picks, as the ring's calls resolve it, and, for
    ``auto``, its class and the kernels passed over with their reasons."""
    device = torch.device(device)
    kernel = resolve_kernel(backend, device, dtype, head_dim, gqa=gqa, softcap=softcap)  # softcap: a kernel that caps
    if backend != "auto":
        return kernel.name, f"backend {backend!r} as set"
    runs = set(available_backends(device, dtype, head_dim, gqa=gqa))
    widest = max(head_dim) if isinstance(head_dim, (tuple, list)) else head_dim  # (d, dv): MLA

    def why_not(other):
        return (other.unavailable_reason(device, dtype, widest)
                or (other.gqa_unavailable_reason(device, dtype, head_dim) if gqa is not False else None)
                or "not for these head dims")

    passed = [f"{name}: {why_not(other)}" for name, other in KERNELS.items() if name not in runs]
    if softcap:
        passed += [f"{name}: {other.softcap_unavailable_reason()}" for name, other in KERNELS.items()
                   if name in runs and name != kernel.name and other.softcap_unavailable_reason() is not None]
    cls = kernel.kernel_class(device, dtype, head_dim, True)
    why = f"backend auto: the fastest class that runs ({cls})"
    return kernel.name, why + (f"; passed over {'; '.join(passed)}" if passed else "")


def cost_model_state(kernel_name: str, device_type: str, how_to_calibrate: str) -> str:
    """The cost model ``kernel_name`` runs by on ``device_type``: a calibration adopted in this
    process (its measured numbers), or the table's (``how_to_calibrate`` says how to measure)."""
    model = cost.model_for(kernel_name, device_type)
    if model != cost.model_for_kernel(kernel_name, device_type):
        return (f"cost model calibrated on this device: {model.ns_per_entry:.3g} ns per score entry, "
                f"{model.call_ns / 1e3:.0f} us per call, causal waste {model.causal_waste:.2f}")
    return f"cost model: the table's {model.label!r}, not calibrated here ({how_to_calibrate})"


def setup_line(route: str, layout_key: str, cp_desc: str, backend: str, device, dtype, head_dim,
               how_to_calibrate: str, gqa: bool | None = None, softcap: float = 0.0) -> str:
    """One line: ``striped_sp on (route): layout ...; CP ...; kernel ... (why); stripes ...; cost model ...``."""
    device = torch.device(device)
    try:
        kernel, why = kernel_choice(backend, device, dtype, head_dim, gqa, softcap)
    except ValueError as err:  # the first call will refuse it, naming the setting
        kernel, why = "none", str(err)
    return (f"striped_sp on ({route}): layout {layout_key}; {cp_desc}; kernel {kernel} on {device.type} "
            f"({why}); {stripe_policy(layout_key)}; {cost_model_state(kernel if kernel != 'none' else backend, device.type, how_to_calibrate)}")
