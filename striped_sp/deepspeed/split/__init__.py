"""Split mixers: a hybrid's non-attention token mixers run on 1/N of the heads (or channels) of
every token instead of on the whole gathered sequence.

One small module per mixer kind knows that kind's forward and where it can be cut (:mod:`.gdn`,
:mod:`.mamba2`, :mod:`.mamba`, :mod:`.short_conv`); the re-layout they share is the core's
(:mod:`striped_sp.engine.head_split`).  :func:`find_split` recognises a module's form (its
parameters, its kernels and its forward's code, never its class name); :func:`split_or_reason` says,
for a group of ``n`` ranks, whether it splits or why it is gathered instead (heads or channels not
divisible by ``n``, a form not recognised).
"""

from __future__ import annotations

import torch

from .gdn import GatedDeltaNetSplit
from .mamba import MambaSplit
from .mamba2 import Mamba2Split
from .short_conv import ShortConvSplit

__all__ = ["SPLITS", "find_split", "split_or_reason"]

#: the forms a mixer can be split in, tried in order
SPLITS = (GatedDeltaNetSplit, Mamba2Split, MambaSplit, ShortConvSplit)


def find_split(module: torch.nn.Module):
    """The split form of ``module`` (an object with ``kind``, ``cannot_split(n)`` and ``run``), or ``None``."""
    for form in SPLITS:
        found = form.recognise(module)
        if found is not None:
            return found
    return None


def split_or_reason(module: torch.nn.Module, n: int):
    """``(split, None)`` when ``module`` splits over ``n`` ranks, else ``(None, reason)``."""
    found = find_split(module)
    if found is None:
        return None, f"{type(module).__name__}'s form is not one the plugin splits"
    reason = found.cannot_split(n)
    return (None, reason) if reason else (found, None)
