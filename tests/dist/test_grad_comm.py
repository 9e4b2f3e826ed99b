"""``grad_comm_dtype``: the dtype dK/dV travel the ring in (4 gloo ranks, bf16 inputs, float64
reference).  float32 (the default) and bfloat16 are both within bf16 tolerance; bfloat16 adds
one rounding per hop, so its error is larger; a bad dtype is a ValueError before any message."""

import math

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import run_cases
from striped_sp.bench.precision import PrecisionConfig, _reference

N = 4


def _errors(comm, layout):
    cfg = PrecisionConfig(tokens=256, heads=2, layout=layout)
    (q, k, v, dout), ref = _reference(cfg)
    rank = dist.get_rank()
    local = [striped_sp.shard(t, N, rank, layout=layout).requires_grad_() for t in (q, k, v)]
    out = striped_sp.ring_attention(*local, layout=layout, grad_comm_dtype=comm)
    out.backward(striped_sp.shard(dout, N, rank, layout=layout))
    errs = []
    for mine, want in zip(local, ref):
        want = striped_sp.shard(want, N, rank, layout=layout)
        sq = torch.tensor([(mine.grad.double() - want).pow(2).sum().item(), want.pow(2).sum().item()])
        dist.all_reduce(sq)
        errs.append(math.sqrt(sq[0].item() / sq[1].item()))
    return errs


def check_grad_comm(layout):
    fp32 = _errors(None, layout)
    bf16 = _errors(torch.bfloat16, layout)
    assert all(e < 1e-2 for e in fp32 + bf16), (fp32, bf16)
    assert bf16[0] == fp32[0]  # dq stays local
    assert bf16[1] > fp32[1] and bf16[2] > fp32[2], (fp32, bf16)  # dk, dv: one rounding per hop


def check_bad_dtype():
    x = torch.randn(1, 8, 2, 16)
    with pytest.raises(ValueError, match="grad_comm_dtype=torch.int8"):
        striped_sp.ring_attention(x, x, x, grad_comm_dtype=torch.int8)
    dist.barrier()


CASES = [("striped", check_grad_comm, ("striped",)), ("zigzag", check_grad_comm, ("zigzag",)),
         ("bad-dtype", check_bad_dtype, ())]
_results = {}


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_grad_comm_dtype_on_4_ranks(name):
    if not _results:
        _results.update(run_cases(N, CASES))
    assert _results[name] is None, _results[name]
