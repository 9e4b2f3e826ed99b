"""Risks a GPU would show, guarded on CPU: a row that sees no key in the merge.

Kernels report a row with no visible key in three ways: lse ``+inf`` (flash-attn 2, PyTorch's flash
op), ``-inf`` (FA3, FA4) with output 0, or NaN.  The merge must give it weight 0 and leave the
accumulators as they are, also where the accumulators themselves hold no key yet (``-inf``).
(flash-attn's ``rng_state`` in the backward: tests/unit/test_cuda_contracts.py, ``_check_fa_args``.)
"""

from __future__ import annotations

import pytest
import torch

from striped_sp.kernels.merge import merge_block, merge_block_safe

INF = float("inf")


def _acc(gen, lse_value=None):
    out = torch.randn(1, 3, 2, 4, generator=gen)  # [b, s, h, d]
    lse = torch.randn(1, 2, 3, generator=gen) if lse_value is None else torch.full((1, 2, 3), lse_value)
    return out, lse


@pytest.mark.parametrize("empty", [INF, -INF, float("nan")], ids=["+inf", "-inf", "nan"])
def test_merge_gives_a_row_without_keys_weight_zero(empty):
    gen = torch.Generator().manual_seed(0)
    out, lse = _acc(gen)
    block_out, block_lse = torch.randn(1, 3, 2, 4, generator=gen), torch.randn(1, 2, 3, generator=gen)
    block_out[:, 1] = 0.0  # row 1 saw no key: output 0, lse as the kernel reports it
    block_lse[:, :, 1] = empty
    want_out, want_lse = out.clone(), lse.clone()
    merge_block(out, lse, block_out, block_lse)
    assert torch.equal(out[:, 1], want_out[:, 1]) and torch.equal(lse[:, :, 1], want_lse[:, :, 1])
    # the other rows merged as softmax says
    w = torch.sigmoid(block_lse - want_lse).transpose(1, 2).unsqueeze(-1)
    for r in (0, 2):
        assert torch.allclose(out[:, r], (want_out + w * (block_out - want_out))[:, r])
        assert torch.allclose(lse[:, :, r], torch.logaddexp(want_lse, block_lse)[:, :, r])


@pytest.mark.parametrize("empty", [INF, -INF, float("nan")], ids=["+inf", "-inf", "nan"])
def test_safe_merge_keeps_rows_that_saw_nothing_yet(empty):
    """Accumulators still at (out 0, lse -inf) meet a block whose row saw no key either: they stay
    so (no NaN), and a later block with keys gives exactly its own result."""
    gen = torch.Generator().manual_seed(1)
    out, lse = torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), -INF)
    block_out, block_lse = torch.zeros(1, 3, 2, 4), torch.full((1, 2, 3), empty)
    merge_block_safe(out, lse, block_out, block_lse)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    real_out, real_lse = torch.randn(1, 3, 2, 4, generator=gen), torch.randn(1, 2, 3, generator=gen)
    merge_block_safe(out, lse, real_out, real_lse)
    assert torch.equal(out, real_out) and torch.equal(lse, real_lse)
