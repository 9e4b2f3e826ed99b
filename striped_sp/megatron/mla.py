"""Multi-latent attention without Transformer Engine: the one megatron-core flag ``install()`` corrects.

megatron-core 0.16.1's ``multi_latent_attention`` sets ``HAVE_TE = True`` whenever
``megatron.core.extensions.transformer_engine`` imports, and that module imports without Transformer
Engine too (it then stands ``te`` in with a ``MagicMock``). ``MLASelfAttention.__init__`` then calls
``isinstance(self.linear_proj, TELinear)`` with a mock as the class and raises
``TypeError: isinstance() arg 2 must be a type, a tuple of types, or a union``: the local spec
(``get_gpt_layer_local_spec(multi_latent_attention=True)``) cannot build a model on a machine
without Transformer Engine.  The check it guards only concerns FP8/FP4 with Transformer Engine's
``TELinear``, which such a machine cannot have, so :func:`te_flag_fix` reports the flag to set to
``False`` there; with Transformer Engine installed (``TELinear`` a class) it reports nothing.
"""

from __future__ import annotations

import sys

__all__ = ["te_flag_fix"]

_MODULE = "megatron.core.transformer.multi_latent_attention"


def te_flag_fix(load: bool = True):
    """``(module, "HAVE_TE", False)`` when megatron-core's MLA module claims Transformer Engine
    while its ``TELinear`` is no class (Transformer Engine absent); ``None`` otherwise (no MLA module
    in this release, Transformer Engine present, or the flag already right).  ``load``: import the
    module first (``install()`` does, so that models built later find the flag set)."""
    if load:
        try:
            __import__(_MODULE)
        except ImportError:
            return None
    module = sys.modules.get(_MODULE)
    if module is None or not getattr(module, "HAVE_TE", False):
        return None
    if isinstance(getattr(module, "TELinear", None), type):
        return None
    return module, "HAVE_TE", False
