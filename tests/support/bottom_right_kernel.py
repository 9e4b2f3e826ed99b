"""A CPU stand-in for a kernel with flash-attn's mask alignment, for the aligned strict block.

``BottomRightMathKernel``: the math kernel, but a non-square causal call aligns its mask
bottom-right (query ``i`` of ``sq`` sees keys ``<= i + sk - sq``, as flash-attn >= 2.1 and
PyTorch's CUDA flash op), and a row that sees no key comes back as flash-attn reports it: lse
``+inf``, and here an output of NaN (the worst a kernel could leave there).  ``fmt`` picks the
tensor format the ring hands it (``"bshd"`` or ``"bhsd"``).  ``calls`` records every native call's
``(sq, sk, causal)`` (``bwd_calls`` the backward's), so a test can see which form ran.
"""

from __future__ import annotations

import torch

from striped_sp.kernels import MathKernel


class BottomRightMathKernel(MathKernel):
    name = "math_bottom_right"

    def __init__(self, fmt: str = "bshd"):
        self.tensor_format = fmt
        self.calls: list[tuple[int, int, bool]] = []
        self.bwd_calls: list[tuple[int, int, bool]] = []

    def _shape(self, q, k, causal):
        d = 1 if self.tensor_format == "bshd" else 2
        return q.size(d), k.size(d), causal

    def causal_alignment(self, device, dtype, head_dim=None):
        return "bottom_right"

    def _scores(self, q, k, causal, scale, mask=None):
        if causal:
            sq, sk = q.size(1), k.size(1)
            i, j = torch.arange(sq).unsqueeze(1), torch.arange(sk).unsqueeze(0)
            mask, causal = j <= i + sk - sq, False
        return super()._scores(q, k, causal, scale, mask)

    def forward(self, q, k, v, causal, scale, mask=None):
        out, lse = super().forward(q, k, v, causal, scale, mask)
        empty = torch.isneginf(lse)  # [b, h, s]
        lse = lse.masked_fill(empty, float("inf"))
        out = out.masked_fill(empty.transpose(1, 2).unsqueeze(-1), float("nan"))
        return out, lse

    def _to_bshd(self, *ts):
        return [t.transpose(1, 2) if self.tensor_format == "bhsd" else t for t in ts]

    def forward_native(self, q, k, v, causal, scale):
        self.calls.append(self._shape(q, k, causal))
        out, lse = self.forward(*self._to_bshd(q, k, v), causal, scale)
        return self._to_bshd(out)[0], lse

    def backward_native(self, dout, q, k, v, out, lse, causal, scale):
        self.bwd_calls.append(self._shape(q, k, causal))
        grads = self.backward(*self._to_bshd(dout, q, k, v, out), lse, causal, scale)
        return tuple(self._to_bshd(*grads))
