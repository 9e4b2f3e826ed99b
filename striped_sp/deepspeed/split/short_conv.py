"""LFM2's short convolution split by channels (``Lfm2ShortConv``, ``Lfm2MoeShortConv``; transformers 5.24).

``in_proj`` gives ``B, C, x`` ``[b, s, hidden]`` on this rank's tokens; ``B * x`` goes through one
all-to-all (rank ``j`` gets channels ``j * hidden / N ...`` of every token in natural order), the
depthwise ``causal_conv1d_fn`` runs there on those rows of ``conv``, one all-to-all brings its
output back, and ``C * conv`` and ``out_proj`` run on this rank's tokens.  No op mixes channels
between the two cuts.
"""

from __future__ import annotations

import torch

from ...engine.head_split import heads_to_tokens, tokens_to_heads
from .heads import kernels_of, source_has

__all__ = ["ShortConvSplit"]


class ShortConvSplit:
    """The split form of one short-convolution module (see the module notes)."""

    kind = "short convolution"

    def __init__(self, module: torch.nn.Module):
        self.module = module
        (self.conv,) = kernels_of(module, "causal_conv1d_fn")

    @classmethod
    def recognise(cls, module: torch.nn.Module) -> "ShortConvSplit | None":
        if not all(hasattr(module, a) for a in ("in_proj", "out_proj", "conv")) or \
                not isinstance(module.conv, torch.nn.Conv1d) or kernels_of(module, "causal_conv1d_fn") is None:
            return None
        if not source_has(module, "B, C, x = BCx.chunk(3, dim=-2)", "hidden_states = B * x", "y = C * hidden_states"):
            return None
        return cls(module)

    def cannot_split(self, n: int) -> str | None:
        channels = self.module.conv.out_channels
        return f"{channels} channels are not divisible by {n} ranks" if channels % n else None

    def run(self, x: torch.Tensor, group, order, kwargs: dict) -> torch.Tensor:
        """``x`` ``[b, S/N, hidden]`` -> the mixer's output for this rank's tokens (``kwargs`` as in
        :meth:`~.gdn.GatedDeltaNetSplit.run`)."""
        m, n, rank = self.module, order.world_size, order.rank
        b, s, _ = x.shape
        B, C, h = m.in_proj(x).chunk(3, dim=-1)
        mixed = tokens_to_heads((B * h).reshape(b, s, n, -1), group, order)  # [b, S, channels / N]
        width = mixed.size(-1)
        mine = slice(rank * width, (rank + 1) * width)
        bias = None if m.conv.bias is None else m.conv.bias[mine]
        conv = self.conv(mixed.transpose(1, 2), m.conv.weight.squeeze(1)[mine], bias, **kwargs)
        conv = heads_to_tokens(conv.transpose(1, 2), group, order).reshape(b, s, -1)
        return m.out_proj((C * conv).contiguous())
