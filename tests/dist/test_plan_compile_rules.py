"""What a compiled plan must carry from its request, each checked by what breaks without it:

* the aligned strict block (``STRIPED_SP_STRICT_BLOCK=aligned``): a dense striped plan compiled for
  a kernel with a bottom-right causal mask reports itself aligned and runs the strict block as one
  non-square call ``q`` x ``k[:-1]`` (not ``q[1:]`` x ``k[:-1]``), exact against float64;
* shared rows: a rank whose trailing rows stay private (a whole document kept on it) sends only
  its leading rows, so the ring carries fewer bytes than whole blocks, and stays exact;
* ``grad_comm_dtype``: the simulator's plans send dK/dV in it.

Every rank of the ring runs in this process on the LocalRing; references are float64 over the
whole sequence (tests/support/reference.py), not the engine."""

from __future__ import annotations

import pytest
import torch

from bottom_right_kernel import BottomRightMathKernel
from reference import reference_attention
from seeds import seed_for
from striped_sp.engine import local
from striped_sp.engine.autograd import backward_steps, forward_steps
from striped_sp.engine.plans import PLANS, plan_for
from striped_sp.engine.step import STRICT_BLOCK_ENV, strict_block_mode
from striped_sp.engine.transport import LocalRing, run_local
from striped_sp.plan.layouts import get_layout, shard, unshard

pytestmark = pytest.mark.dist


def _inputs(name: str, seq: int, heads: int = 2, dim: int = 8, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed_for(name))
    return [torch.randn(1, seq, heads, dim, generator=gen, dtype=dtype) for _ in range(4)]  # q, k, v, dout


def _reference(q, k, v, dout, scale, cu_seqlens=None):
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, scale, cu_seqlens, None)
    (ref * dout).sum().backward()
    return ref.detach(), qr.grad, kr.grad, vr.grad


def _max_errors(got, want) -> dict:
    return {name: (g - w).abs().max().item() for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}


@pytest.mark.parametrize("form", ["aligned", "sliced"])
def test_the_strict_block_form_reaches_the_compiled_plan(form, monkeypatch):
    n, per_rank, dim = 4, 6, 8
    seq, scale = n * per_rank, dim ** -0.5
    q, k, v, dout = _inputs(f"strict-block-{form}", seq)
    kernel = BottomRightMathKernel("bshd")
    monkeypatch.setenv(STRICT_BLOCK_ENV, form)
    mode = strict_block_mode(kernel, torch.device("cpu"), q.dtype, dim)  # as RingRequest reads it
    assert mode == form
    PLANS.clear()
    layout = get_layout("striped:stripe=1")  # the striped strict block: stripes of 1 pinned
    plans = [plan_for(layout, None, True, n, r, per_rank, kernel=kernel, scale=scale, comm_dtype=torch.float64,
                      strict_block=mode, dtype=q.dtype, head_dim=dim) for r in range(n)]
    assert [p.aligned for p in plans] == [form == "aligned"] * n
    parts = [[shard(t, n, r, layout=layout) for r in range(n)] for t in (q, k, v, dout)]
    ring = LocalRing(n)
    fwd = run_local([forward_steps(parts[0][r], parts[1][r], parts[2][r], plans[r], ring.transports[r])
                     for r in range(n)])
    bwd = run_local([backward_steps(parts[3][r], parts[0][r], parts[1][r], parts[2][r], *fwd[r], plans[r],
                                    ring.transports[r]) for r in range(n)])
    # the strict block (keys of a later rank): aligned, all n queries against n - 1 keys, bottom-right
    strict = (per_rank, per_rank - 1, True) if form == "aligned" else (per_rank - 1, per_rank - 1, True)
    # ranks r < n - 1 meet a strict block from each later rank: sum over r of (n - 1 - r)
    assert kernel.calls.count(strict) == n * (n - 1) // 2, kernel.calls
    assert all(sq == sk for sq, sk, _ in kernel.calls if (sq, sk, True) != strict), kernel.calls
    assert kernel.bwd_calls.count(strict) >= n * (n - 1) // 2, kernel.bwd_calls
    got = [unshard([f[0] for f in fwd], layout=layout)] + [unshard([b[i] for b in bwd], layout=layout)
                                                          for i in range(3)]
    errs = _max_errors(got, _reference(q, k, v, dout, scale))
    assert max(errs.values()) < 1e-10, errs


def test_a_rank_with_private_trailing_rows_sends_only_its_shared_rows():
    """N = 4, 64 tokens per rank, documents of 30, 10, 160 and 56 tokens, those up to 64 kept whole:
    rank 0 keeps the 10-token document as its last 10 rows, which no other rank sees, so its blocks
    travel with 54 rows, every other rank's with all 64."""
    n, bounds = 4, [0, 30, 40, 200, 256]
    q, k, v, dout = _inputs("shared-rows", 256)
    sim = local.simulate(q, k, v, n, dout, backend="torch", layout="striped:place=64", cu_seqlens=bounds)
    plans = sim.plans[0]
    assert [p.shared for p in plans] == [(54, 64, 64, 64)] * n
    assert [p.steps for p in plans] == [n] * n
    # forward: N - 1 transfers of K and V (2 kv heads x 8, float64) of every rank's shared rows
    row_bytes = 2 * 2 * 8 * 8
    forward = (n - 1) * (54 + 3 * 64) * row_bytes
    assert forward == 188_928
    assert sim.rings[0].sent_bytes == 629_760, sim.rings[0].sent_bytes  # whole blocks: 655,360
    errs = _max_errors((sim.out, sim.dq, sim.dk, sim.dv), _reference(q, k, v, dout, 8 ** -0.5, bounds))
    assert max(errs.values()) < 1e-10, errs


def test_simulate_sends_gradients_in_grad_comm_dtype():
    n = 4
    q, k, v, dout = _inputs("grad-comm-simulate", 32, dtype=torch.float32)
    runs = {dt: local.simulate(q, k, v, n, dout, backend="torch", layout="striped", grad_comm_dtype=dt)
            for dt in (torch.bfloat16, torch.float32)}
    assert {p.comm_dtype for p in runs[torch.bfloat16].plans[0]} == {torch.bfloat16}
    assert {p.comm_dtype for p in runs[torch.float32].plans[0]} == {torch.float32}
    # dK/dV travel in half the bytes; K and V themselves (float32) do not change
    assert runs[torch.bfloat16].rings[0].sent_bytes < runs[torch.float32].rings[0].sent_bytes
    want = _reference(q, k, v, dout, 8 ** -0.5)
    errs = _max_errors((runs[torch.bfloat16].out, runs[torch.bfloat16].dq, runs[torch.bfloat16].dk,
                        runs[torch.bfloat16].dv), want)
    assert max(errs.values()) < 5e-2, errs  # bfloat16 partial sums: loose, but not wrong
