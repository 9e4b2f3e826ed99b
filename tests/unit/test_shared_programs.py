"""Ring steps with equal segments share one compiled program (kernels without a varlen entry
point): zigzag on documents padded to 2N has the same segments at every step after the first."""

from __future__ import annotations

import pytest
import torch

from reference import reference_attention
from seeds import seed_for
from striped_sp.engine import local
from striped_sp.kernels import KERNELS


def _programs(plan) -> list:
    return [p for step in plan.programs for p in step]


@pytest.mark.parametrize("layout,lengths,shared", [
    ("zigzag", [24, 8, 40, 16, 32, 8], True),  # multiples of 2N: zigzag splits each document evenly
    ("striped:stripe=1", [24, 8, 40, 16, 32, 8], True),  # multiples of N: so does striped
    ("striped:stripe=1", [23, 9, 41, 15, 33, 7], False),  # source ranks hold other key counts
], ids=["zigzag", "striped-even", "striped-uneven"])
def test_steps_of_equal_segments_share_one_program_and_stay_exact(layout, lengths, shared):
    n, h, kvh, d = 4, 2, 1, 8
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    seq = cu[-1]
    gen = torch.Generator().manual_seed(seed_for(f"shared-programs-{layout}"))
    q, do = (torch.randn(1, seq, h, d, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, seq, kvh, d, generator=gen, dtype=torch.float64) for _ in range(2))
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, d ** -0.5, cu, None)
    (ref * do).sum().backward()
    sim = local.simulate(q, k, v, n, do, kernel=KERNELS["torch"], layout=layout, cu_seqlens=cu)
    for rank, plan in enumerate(sim.plans[0]):
        assert plan.masked and plan.steps == n
        programs = _programs(plan)
        assert len(programs) == n
        segs = [c.segments for step in plan.calls for c in step]
        for i in range(n):
            for j in range(i):
                same = all(torch.equal(getattr(segs[i], f), getattr(segs[j], f))
                           for f in ("cu_q", "cu_k", "wl", "wr", "q_start", "k_start"))
                assert (programs[i] is programs[j]) == same, (rank, i, j, same)
        if shared:  # documents split evenly: some steps alike on every rank
            assert len({id(p) for p in programs}) < n, rank
    for name, got, want in (("out", sim.out, ref), ("dq", sim.dq, qr.grad), ("dk", sim.dk, kr.grad),
                            ("dv", sim.dv, vr.grad)):
        err = (got - want.detach()).abs().max().item() / max(1.0, want.abs().max().item())
        assert err < 1e-10, (name, err)


def test_a_program_is_shared_only_by_equal_segments():
    """Each field of the segments tells programs apart; equal values in other tensors do not."""
    from striped_sp.kernels.arena import Arena
    from striped_sp.kernels.segments import Segments
    from striped_sp.kernels.varlen import compile_steps

    def segs(**change):
        fields = dict(cu_q=[0, 20, 50], cu_k=[0, 20, 50], wl=[-1, 9], wr=[0, 0], q_start=[0, 20], k_start=[0, 20])
        fields.update(change)
        return Segments(**{f: torch.tensor(x) for f, x in fields.items()})

    others = [segs(cu_k=[0, 21, 51]), segs(wl=[-1, 8]), segs(wr=[0, 1]), segs(q_start=[1, 21]),
              segs(k_start=[0, 21]), segs(cu_q=[0, 20, 49])]
    steps = [[segs()], [segs()], *([s] for s in others)]
    programs = [step[0] for step in compile_steps(KERNELS["torch"], steps, 1, 60, 60, "cpu", torch.float32, 8,
                                                  Arena())]
    assert programs[0] is programs[1]
    assert len({id(p) for p in programs[1:]}) == len(others) + 1
