"""LFM2's short convolution on contiguous chunks: only a halo joins them (the previous chunk's last
``k - 1`` inputs of the convolution), no state; the gates and projections run on the chunk."""

from __future__ import annotations

import torch

from ...engine.state_passing import ContiguousChunks, from_chunks, to_chunks
from ..split.short_conv import ShortConvSplit
from .common import StateForm, conv_with_halo, documents_of

__all__ = ["ShortConvState"]


class ShortConvState(StateForm):
    """The state-passing form of one short-convolution module."""

    kind = "short convolution"
    split_form = ShortConvSplit

    def run(self, x: torch.Tensor, group, plan: ContiguousChunks, kwargs: dict) -> torch.Tensor:
        m = self.module
        self.check(plan, m.conv)
        plan, kwargs, resets = documents_of(plan, kwargs, "seq_idx")
        if resets:  # before the re-layout
            self.check_packed(plan, seq_idx=self.split.conv)
        B, C, h = m.in_proj(to_chunks(x, group, plan)).chunk(3, dim=-1)
        conv = conv_with_halo(self.split.conv, B * h, m.conv.weight.squeeze(1), m.conv.bias, group, plan, resets,
                              **kwargs)
        return from_chunks(m.out_proj((C * conv).contiguous()), group, plan)
