"""State passing on the Hugging Face path: a hybrid's gated delta net, Mamba2 and short-convolution
mixers run on contiguous chunks of the row, joined by their states (:mod:`striped_sp.engine.state_passing`,
:mod:`striped_sp.engine.state_fold`), with no head count to divide: past the heads (``N`` larger than the
head count, or heads that do not divide by ``N``) they run here instead of on the gathered row.

One module per kind (:mod:`.mamba2`, :mod:`.gdn`, :mod:`.short_conv`), each built on the split form
of :mod:`striped_sp.deepspeed.split` that recognises the module (its projections, kernels and gated
norm are the same; only the middle differs).  A form's ``run(x, group, plan, kwargs)`` takes this
rank's tokens ``[b, S/N, hidden]`` in the layout's order and the per-token keyword arguments already
re-laid into the chunk (:func:`~striped_sp.engine.state_passing.to_chunks`), and returns the mixer's
output for this rank's tokens: one all-to-all of the hidden states each way, a halo and one summary
all-gather per layer.
"""

from __future__ import annotations

import torch

from .gdn import GatedDeltaNetState
from .mamba2 import Mamba2State
from .short_conv import ShortConvState

__all__ = ["STATE_FORMS", "find_state"]

#: the forms that pass state, tried in order
STATE_FORMS = (GatedDeltaNetState, Mamba2State, ShortConvState)


def find_state(module: torch.nn.Module):
    """The state-passing form of ``module`` (``kind``, ``cannot_pass(n)``, ``run``), or ``None``."""
    for form in STATE_FORMS:
        found = form.recognise(module)
        if found is not None:
            return found
    return None
