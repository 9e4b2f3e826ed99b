"""``stripe_size="auto"``: the stripe size that measured fastest for a model's rows and layers.

The data layout is shared by every layer, so the choice looks at the whole model: whether rows
are packed documents, and which share of its visible score entries lies in sliding-window layers
(Gemma / Mistral-style models alternate window and global layers).  The rule, from ``bench sim``
(N=8, 8192 tokens per rank, fwd+bwd, a 2-core CPU; docs/tuning.md, "Stripe size"):

* no window layers: on packed rows ``"auto"``, the per-batch search of
  :mod:`striped_sp.plan.search` (stripe size and whole-document placement by the kernel's cost
  model; per-document stripes measured fastest of the fixed choices); on a single-document row the
  paper's token-by-token stripes (1), which run the dense causal plans;
* any window on packed rows: stripes of ``W / 8`` (a power of two, at least :data:`MIN_STRIPE`), so
  that a query's band lies in a few stripes (1.36x zigzag on the web mix), from
  :data:`PACKED_WINDOW_MIN_RANKS` ranks on; on fewer the per-batch search;
* one document, window layers of ``W`` keys holding at least :data:`WINDOW_SHARE_MIN` of the
  entries: stripes of ``W / 4`` (the same bounds).  ``W / 8`` measured 1.21x zigzag at one global
  layer in six, ``W / 2`` 1.35x with no global layer; a later run (N = 8, W = 4096, a loaded
  machine) put ``W / 4`` 7% ahead of ``W / 8`` at one global layer in six and within 1% of the best
  without global layers, and at N = 2 (W = 1024, a quiet machine) 9% ahead without global layers
  (docs/results.md, "Windows: the stripe size");
* otherwise 1.
"""

from __future__ import annotations

import numbers

__all__ = ["WINDOW_SHARE_MIN", "MIN_STRIPE", "PACKED_WINDOW_MIN_RANKS", "window_share", "choose_stripe_size", "check_window_hint",
           "window_layer_counts"]

#: window layers must hold this share of the entries before stripes pay on one document
#: (measured crossover: one global layer in 3.05, window 4096, 65536 tokens)
WINDOW_SHARE_MIN = 0.20
#: smaller stripes than this cost more per entry than they gain (kernel tiles)
MIN_STRIPE = 64
#: from this many ranks a packed row under a window hint runs stripes of W / 8 rather than the
#: per-batch search (which knows no windows): ``bench sim``, web mix, window 4096, 8192 tokens per
#: rank, fwd+bwd: the search 11% faster at N = 2, W / 8 6% faster at N = 4 and 42% at N = 8
PACKED_WINDOW_MIN_RANKS = 4


def _causal_entries(seq_len: int, window: int | None) -> int:
    """Visible entries of one causal document of ``seq_len`` tokens (``window``: keys before a query)."""
    if window is None or window + 1 >= seq_len:
        return seq_len * (seq_len + 1) // 2
    band = window + 1
    return band * (band + 1) // 2 + (seq_len - band) * band


def window_share(seq_len: int, window: int | None, window_layers: int, global_layers: int) -> float:
    """The share of a model's visible score entries in its window layers, for one document of
    ``seq_len`` tokens (0.0 without a window or window layers)."""
    if window is None or window_layers <= 0:
        return 0.0
    w = window_layers * _causal_entries(seq_len, window)
    return w / (w + global_layers * _causal_entries(seq_len, None))


def choose_stripe_size(seq_len: int, world_size: int, packed: bool, window: int | None = None,
                       window_layers: int = 0, global_layers: int = 1) -> int | str:
    """The stripe size for ``stripe_size="auto"`` (module docstring): ``"auto"`` (the per-batch
    search), 1 or a power of two dividing ``seq_len / world_size`` (when the row is not packed; halved
    under :data:`MIN_STRIPE` where ``seq_len / world_size`` needs it: Megatron's flag takes it so, the
    striped window hint falls back to 1 there, :meth:`striped_sp.plan.layouts.Striped.row_stripe`).
    ``ValueError`` on a bad count."""
    for name, value in (("seq_len", seq_len), ("world_size", world_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if window_layers < 0 or global_layers < 0 or window_layers + global_layers == 0:
        raise ValueError(f"window_layers={window_layers}, global_layers={global_layers}: need layers >= 0, "
                         "at least one")
    share = window_share(seq_len, window, window_layers, global_layers)
    if window is None or window_layers == 0 or (not packed and share < WINDOW_SHARE_MIN):
        return "auto" if packed else 1
    if packed and world_size < PACKED_WINDOW_MIN_RANKS:
        return "auto"
    stripe = MIN_STRIPE
    while stripe * 2 <= window // (8 if packed else 4):
        stripe *= 2
    if not packed:  # a plain striped row needs S % (N * s) == 0
        while stripe > 1 and seq_len % (world_size * stripe):
            stripe //= 2
    return stripe


def check_window_hint(window, global_every) -> tuple[int | None, int | None]:
    """The striped layout's window hint (``"striped:window=W,global_every=K"``): ``window`` the
    model's sliding window in tokens (transformers' ``sliding_window``), ``global_every`` one global
    causal layer in every ``K`` layers (``None``: every layer has the window).  ``ValueError`` for
    anything but positive ints, or ``global_every`` without a ``window``."""
    for name, value in (("window", window), ("global_every", global_every)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1):
            raise ValueError(f"layout parameter {name}={value!r} must be a positive int"
                             + (" (the model's sliding window in tokens)" if name == "window" else
                                " (one global layer in every K layers)"))
    if global_every is not None and window is None:
        raise ValueError(f"layout parameter global_every={global_every} needs window=W (the sliding window "
                         "of the other layers)")
    return (None if window is None else int(window)), (None if global_every is None else int(global_every))


def window_layer_counts(global_every: int | None) -> tuple[int, int]:
    """``(window_layers, global_layers)`` in a block of ``global_every`` layers (``None``: all windowed)."""
    return (1, 0) if global_every is None else (global_every - 1, 1)
