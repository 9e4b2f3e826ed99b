"""The layouts by name: :data:`LAYOUTS`, the adapters' algorithm names (:data:`ALGOS`) and
:func:`get_layout`, which reads a name with its parameters (``"striped:stripe=128,place=auto"``).
"""

from __future__ import annotations

import re

from .chunk_layouts import Contiguous, Zigzag
from .layout_base import Layout
from .striped_layout import Striped

__all__ = ["LAYOUTS", "ALGOS", "get_layout"]

LAYOUTS: dict[str, Layout] = {cls.name: cls() for cls in (Striped, Zigzag, Contiguous)}
#: the adapters' algorithm names (``--context-parallel-algo``, the DeepSpeed section's ``algo``,
#: ``DistributedAttention(layout=)``) -> the layout they run: ``ring`` is ``contiguous``
ALGOS: dict[str, str] = {"striped": "striped", "zigzag": "zigzag", "ring": "contiguous"}


def _parse_params(text: str) -> dict:
    """``"stripe=128,place=auto"`` -> ``{"stripe_size": 128, "doc_placement": "auto"}``."""
    names = {"stripe": "stripe_size", "place": "doc_placement", "window": "window", "global_every": "global_every",
             "order": "order"}
    params = {}
    for item in filter(None, text.split(",")):
        key, sep, val = item.partition("=")
        if not sep or key.strip() not in names:
            raise ValueError(f"layout parameter {item!r}: expected stripe=<int>|doc|auto, place=split|auto|<int>, "
                             "window=<int>, global_every=<int> or order=round|mirror")
        val = val.strip()
        params[names[key.strip()]] = int(val) if re.fullmatch(r"-?[0-9]+", val) else val
    return params


def get_layout(layout: str | Layout, stripe_size: int | None = None, doc_placement=None) -> Layout:
    """The :class:`Layout` named ``layout`` (or ``layout`` itself); ``ValueError`` if unknown.

    A striped layout takes parameters, in the name (``"striped:stripe=128,place=auto"``, what
    :attr:`Layout.key` prints) or as arguments (``stripe_size``, ``doc_placement``; ``None``: keep
    the name's or the default)."""
    if isinstance(layout, Layout):
        if stripe_size is None and doc_placement is None:
            return layout
        base, params = layout, {}
        if isinstance(layout, Striped) and not layout.default:
            params = {"stripe_size": layout.stripe_size, "doc_placement": layout.doc_placement,
                      "window": layout.window, "global_every": layout.global_every, "order": layout.order}
    else:
        if not isinstance(layout, str):
            raise ValueError(f"unknown layout {layout!r}: expected one of {sorted(LAYOUTS)}")
        name, _, rest = layout.partition(":")
        if name not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}: expected one of {sorted(LAYOUTS)}")
        base, params = LAYOUTS[name], _parse_params(rest)
        if params and name != "striped":
            raise ValueError(f"layout {layout!r}: only 'striped' takes stripe / place / window / order parameters")
    given = {k: v for k, v in (("stripe_size", stripe_size), ("doc_placement", doc_placement)) if v is not None}
    if given and not isinstance(base, Striped):
        raise ValueError(f"stripe_size / doc_placement ({given}) apply to layout 'striped' only, not {base.name!r}")
    params.update(given)
    if not isinstance(base, Striped) or (not params and base.default):
        return base if not isinstance(base, Striped) else LAYOUTS["striped"]
    if not params:
        return base
    lay = Striped(**params)
    return LAYOUTS["striped"] if lay.key == LAYOUTS["striped"].key else lay
