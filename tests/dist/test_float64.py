"""float64 inputs are computed in float64 end to end (kernels' lse, the merge, dQ/dK/dV and their
travel), not silently at float32 accuracy: errors against an independent float64 reference stay
near float64 rounding (~1e-15), far below float32's ~1e-7."""

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import check_case, run_cases
from reference import reference_attention, rel_err
from seeds import seed_for

SEED = seed_for(__name__)
TOL = 1e-11  # float32 accumulation anywhere gives >= 1e-8 here


def check_float64(backend, layout, masked, ulysses):
    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(SEED)
    s = 2 * n * 11  # 44 tokens: zigzag-compatible, not a power of two
    q = torch.randn(1, s, 4, 16, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(1, s, 2, 16, dtype=torch.float64, generator=gen) for _ in range(2))
    dout = torch.randn(1, s, 4, 16, dtype=torch.float64, generator=gen)
    cu = torch.tensor([0, 12, 20, s]) if masked and layout != "zigzag" else (
        torch.tensor([0, 4 * n, s]) if masked else None)
    window = (9, 0) if masked else None
    scale = 0.37
    shard = (lambda t: striped_sp.shard(t, n, rank, layout=layout, cu_seqlens=cu))
    local = [shard(t).requires_grad_() for t in (q, k, v)]
    out = striped_sp.ring_attention(*local, layout=layout, backend=backend, softmax_scale=scale, cu_seqlens=cu,
                                    window_size=window, ulysses_size=ulysses)
    assert out.dtype == torch.float64
    out.backward(shard(dout))
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, True, scale, cu_seqlens=cu, window_size=window)
    ref.backward(dout)
    errs = {name: rel_err(got, shard(want)) for name, got, want in
            (("out", out, ref), ("dq", local[0].grad, refs[0].grad), ("dk", local[1].grad, refs[1].grad),
             ("dv", local[2].grad, refs[2].grad))}
    assert all(e < TOL for e in errs.values()), f"seed={SEED}: errors {errs} above {TOL}"


CASES = [(f"{b}-{lay}-{'masked' if m else 'dense'}-u{u}", check_float64, (b, lay, m, u))
         for b in ("torch", "math") for lay in ("striped", "zigzag") for m in (False, True) for u in (1, 2)]
_results = {}


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_float64_is_exact(name):
    if "all" not in _results:
        _results["all"] = run_cases(2, CASES)
    check_case(_results["all"], name)


def check_float64_after_float32_on_one_request():
    """One request called in float32, then in float64 with the same shapes: the second call is
    float64 end to end (its own checked call, dK/dV sent in float64), not the first call's settings."""
    n, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(SEED + 1)
    s, scale = 2 * n * 11, 0.37
    q, dout = (torch.randn(1, s, 4, 16, dtype=torch.float64, generator=gen) for _ in range(2))
    k, v = (torch.randn(1, s, 2, 16, dtype=torch.float64, generator=gen) for _ in range(2))
    request = striped_sp.RingRequest(softmax_scale=scale)
    shard = (lambda t: striped_sp.shard(t, n, rank))
    for dtype in (torch.float32, torch.float64):
        local = [shard(t).to(dtype).requires_grad_() for t in (q, k, v)]
        out = request(*local)
        out.backward(shard(dout).to(dtype))
    assert out.dtype == torch.float64 and all(t.grad.dtype == torch.float64 for t in local)
    refs = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*refs, True, scale)
    ref.backward(dout)
    errs = {name: rel_err(got, shard(want)) for name, got, want in
            (("out", out, ref), ("dq", local[0].grad, refs[0].grad), ("dk", local[1].grad, refs[1].grad),
             ("dv", local[2].grad, refs[2].grad))}
    assert all(e < TOL for e in errs.values()), f"seed={SEED}: errors {errs} above {TOL}"


def test_float64_after_float32_on_one_request_is_exact():
    name = "float64_after_float32"
    check_case(run_cases(2, [(name, check_float64_after_float32_on_one_request, ())]), name)
