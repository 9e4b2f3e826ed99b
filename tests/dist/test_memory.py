"""Per-rank peak memory of ring_attention fwd+bwd (issue 19, deliverable 4).

One 4-rank gloo world; every case measures, on each rank, the peak of a whole fwd+bwd (q, k, v and
dout allocated inside the window, so the inputs count) with :class:`striped_sp.bench.memory.MemoryPeak`
(the CPU allocator's events, exact and deterministic: no timing, no sampling), against one process
running PyTorch's fused causal SDPA fwd+bwd over the whole sequence the same way (rank 0 measures it
and broadcasts the number).  8 heads x 64, float32, 4096 tokens in all.

* N=2 (the sub-groups [0, 2] and [1, 3]), 2048 tokens/rank: at most 0.735x the one process
  (measured 0.7260 striped, 0.7256 zigzag here, 0.72 at 8192 tokens/rank, docs/results.md "Memory
  per rank"; the issue's target was 0.75);
* N=4, 1024 tokens/rank: at most 0.435x the one process (measured 0.4245) and 0.60x the N=2 peak
  (measured 0.5847): the inputs fall as 1/N and so does what the ring adds.

The numbers are exact counts of a deterministic program (equal to the byte on reruns but for a few
dozen bytes of the process group's own), so the margins are small: about 1-3 %, a sixth of one local
``[1, s, 8, 64]`` fp32 tensor at N=2.  What they catch, planted in the executor: dK/dV sent the step
before held through the next step's kernels (N=2 0.835x, N=4 0.479x); the K/V block sent on held one
step too long in backward (N=4 0.465x, N=4 / N=2 0.641; at N=2 the peak is the same to the byte:
its backward shifts K/V once, so nothing is held past a later shift).  A kernel whose temporaries
grow (another torch release) moves them and shows here.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import striped_sp
from dist_helper import CaseTable, check_case, cp_group
from seeds import seed_for
from striped_sp.bench.memory import MemoryPeak

SEQ, HEADS, HEAD_DIM = 4096, 8, 64
TARGET_N2 = 0.735  # N=2 (measured 0.7260; the target was 0.75)
BOUND_N4 = 0.435  # N=4: below half of one process (measured 0.4245)
FALL_N4_OVER_N2 = 0.60  # N=4 against N=2, same sequence (measured 0.5847)

_peaks = {}  # per rank process: measured bytes, by case


def _fwd_bwd_peak(tokens: int, attend, seed: int) -> int:
    gen = torch.Generator().manual_seed(seed)
    with MemoryPeak("cpu") as mem:
        q, k, v, dout = (torch.randn(1, tokens, HEADS, HEAD_DIM, generator=gen) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        (attend(q, k, v) * dout).sum().backward()
        assert q.grad is not None and k.grad is not None and v.grad is not None
        del q, k, v, dout
    return mem.peak


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def measure_reference():
    """Rank 0 measures one process on the whole sequence; every rank gets the number."""
    peak = torch.zeros(1, dtype=torch.float64)
    if dist.get_rank() == 0:
        peak += _fwd_bwd_peak(SEQ, _sdpa, seed_for("test_memory.reference"))
    dist.broadcast(peak, 0)
    _peaks["reference"] = int(peak.item())
    assert _peaks["reference"] > 0


def measure_ring(n, layout):
    group, _ = cp_group(n)
    _peaks[(n, layout)] = _fwd_bwd_peak(
        SEQ // n, lambda q, k, v: striped_sp.ring_attention(q, k, v, group, layout=layout),
        seed_for(f"test_memory.{n}.{layout}"))


def _report(name, peak, ref):
    return f"{name}: peak {peak / 2**20:.1f} MiB on rank {dist.get_rank()} = {peak / ref:.3f}x one process " \
           f"({ref / 2**20:.1f} MiB)"


def check_n2_target(layout):
    ref, peak = _peaks["reference"], _peaks[(2, layout)]
    assert peak <= TARGET_N2 * ref, _report(f"N=2 {layout}", peak, ref) + f" > {TARGET_N2}x"


def check_n4_falls():
    ref, p2, p4 = _peaks["reference"], _peaks[(2, "striped")], _peaks[(4, "striped")]
    assert p4 <= BOUND_N4 * ref, _report("N=4 striped", p4, ref) + f" > {BOUND_N4}x"
    assert p4 <= FALL_N4_OVER_N2 * p2, f"N=4 peak {p4 / 2**20:.1f} MiB is {p4 / p2:.3f}x the N=2 peak " \
                                       f"{p2 / 2**20:.1f} MiB (bound {FALL_N4_OVER_N2})"


_CASES = [
    ("setup", measure_reference, ()),
    ("ring_2_striped", measure_ring, (2, "striped")),
    ("ring_2_zigzag", measure_ring, (2, "zigzag")),
    ("ring_4_striped", measure_ring, (4, "striped")),
    ("n2_striped", check_n2_target, ("striped",)),
    ("n2_zigzag", check_n2_target, ("zigzag",)),
    ("n4_falls", check_n4_falls, ()),
]
_TABLE = CaseTable({4: _CASES})


@pytest.mark.parametrize("world,name", _TABLE.params())
def test_memory(world, name):
    check_case({"setup": _TABLE.result(world, "setup"), name: _TABLE.result(world, name)}, name)
