"""The striped default's window hint from a transformers model (issue 36).

Which tokens a rank holds is chosen once per batch, where the batch is sharded, for every layer of
the model, and the window of a layer is not known there.  The DeepSpeed routes know the model
before any batch is sharded, so where the JSON gives no ``stripe_size`` / ``doc_placement`` they
read the model's window once and run ``"striped:window=W,global_every=K"``
(:class:`striped_sp.plan.layouts.Striped`): one-document rows in the window rule's stripes, packed
rows in stripes of ``W / 8`` from 4 ranks on (searched as without it on fewer).  The model's text
config says it:

* ``sliding_window=W`` (an int; ``None`` or absent: no window);
* ``layer_types`` (transformers 5: ``"sliding_attention"`` / ``"full_attention"`` per layer, as
  Gemma 2/3, Qwen2 with ``use_sliding_window``, GPT-OSS give): ``K`` is the layer count over the
  global layers' count, rounded; no sliding layer, or more global layers than sliding ones (their
  window share is then far under the rule's 20% on rows much longer than the window): no hint; no
  global layer: every layer windowed;
* no ``layer_types``: every layer has the window (Mistral), unless ``use_sliding_window`` is False.

Only where the route also shards the batches: ``initialize`` with ``training_data`` (its loader),
the Trainer and accelerate routes (their loaders).  A user who shards batches themselves was told to
shard in ``"striped"``; ``initialize`` without ``training_data`` keeps that layout.
"""

from __future__ import annotations

import dataclasses
import numbers

from .config import ALGOS, ContextParallelSettings

__all__ = ["model_window", "with_model_window"]


def model_window(model) -> tuple[int, int | None] | None:
    """``(W, K)`` of a transformers model (module notes), ``K = None`` when every layer has the
    window; ``None`` for a model without a window, or one that is not a transformers model (a
    ``DistributedAttention`` model's ``config`` may mean anything)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "set_attn_implementation"):
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
        return None
    types = getattr(text, "layer_types", None)
    if isinstance(types, (list, tuple)) and types:
        local = sum(t == "sliding_attention" for t in types)
        full = sum(t == "full_attention" for t in types)
        if local == 0 or full > local:
            return None
        return int(window), (None if full == 0 else max(2, round((local + full) / full)))
    if getattr(text, "use_sliding_window", True) is False:
        return None
    return int(window), None


def with_model_window(settings: ContextParallelSettings, model) -> ContextParallelSettings:
    """``settings`` with the window hint of ``model`` where they run the striped default (no
    ``stripe_size`` or ``doc_placement`` given) with SP on; else ``settings`` unchanged."""
    if (not settings.enabled or ALGOS[settings.algo] != "striped" or settings.stripe_size is not None
            or settings.doc_placement is not None or settings.order == "mirror" or model is None):
        return settings
    hint = model_window(model)
    if hint is None:
        return settings
    return dataclasses.replace(settings, window=hint[0], global_every=hint[1])
