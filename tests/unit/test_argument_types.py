"""Leftovers of the API fuzz (issue 46, item 7): NumPy bools are bools, a bad ``prepare_plans`` sequence
length names ``seq_len``, and an empty local sequence is named as one."""

from __future__ import annotations

import pytest
import torch

import striped_sp
from reference import reference_attention, rel_err
from striped_sp.engine.request import RingRequest, check_flag

numpy = pytest.importorskip("numpy")


@pytest.mark.parametrize("value", [False, True])
def test_numpy_bools_are_bools(value):
    assert check_flag("causal", numpy.bool_(value)) is value
    request = RingRequest(None, causal=numpy.bool_(value), deterministic=numpy.bool_(value))
    assert request.causal is value and request.deterministic is value


def test_other_numpy_scalars_are_named_with_their_module():
    with pytest.raises(TypeError, match=r"causal=np.float64\(1.0\) must be a bool, got numpy.float64"):
        RingRequest(None, causal=numpy.float64(1.0))
    with pytest.raises(TypeError, match="must be a bool, got str"):
        RingRequest(None, deterministic="False")


def test_numpy_false_runs_the_full_attention(world_of_one):
    """``causal=numpy.bool_(False)`` on CP = 1: the non-causal result, against float64."""
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 12, heads, 8, generator=gen, dtype=torch.float64) for heads in (4, 2, 2))
    out = striped_sp.ring_attention(q, k, v, causal=numpy.bool_(False))
    assert rel_err(out, reference_attention(q, k, v, False, 8 ** -0.5)) < 1e-10
    assert rel_err(out, reference_attention(q, k, v, True, 8 ** -0.5)) > 1e-2


@pytest.mark.parametrize("seq_len", [8.0, "8", None, True, 8.5])
def test_prepare_plans_names_a_bad_sequence_length(seq_len):
    with pytest.raises(TypeError, match=r"seq_len=.* must be an int"):
        striped_sp.prepare_plans(seq_len, world_size=2, rank=0)
    with pytest.raises(TypeError, match=r"seq_len=.* must be an int"):  # before looking up a group
        striped_sp.prepare_plans(seq_len)


def test_prepare_plans_takes_numpy_ints():
    plan = striped_sp.prepare_plans(numpy.int64(16), world_size=2, rank=1)
    assert plan is striped_sp.prepare_plans(16, world_size=2, rank=1)


def test_empty_local_sequence_is_named(world_of_one):
    q, k, v = (torch.randn(1, 0, heads, 8) for heads in (4, 2, 2))
    with pytest.raises(ValueError, match=r"q has shape \(1, 0, 4, 8\): an empty local sequence \(s_local = 0\): "
                                         "the local sequence length must be positive"):
        striped_sp.ring_attention(q, k, v)
