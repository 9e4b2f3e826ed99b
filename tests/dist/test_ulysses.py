"""Hierarchical CP (Ulysses all-to-all inside, the ring across) on 4 gloo ranks, against a
float64 single-process reference (forward and gradients): N=4 as u x r = 2x2, 4x1 and 1x4, every
layout, MHA/GQA/MQA, fp32/bf16, with documents and windows; explicit groups; bad input."""

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import run_cases
from reference import reference_attention, sharded_errors
from seeds import seed_for

SEED = seed_for(__name__)  # fixed (tests/support/seeds.py): the same in every spawned rank
SCALE = 0.3  # not the default head_dim ** -0.5 = 0.25 (head_dim 16): a dropped scale fails
WORLD = 4
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (8, 1)}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def check_hierarchical(u, layout, heads, dtype, seed, bounds=None, window=None, explicit=False, local_len=8):
    rank = dist.get_rank()
    seq = local_len * WORLD
    h, kvh = HEADS[heads]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, seq, h, 16, generator=gen).to(dtype)
    k, v = (torch.randn(1, seq, kvh, 16, generator=gen).to(dtype) for _ in range(2))
    dout = torch.randn(1, seq, h, 16, generator=gen).to(dtype)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, SCALE, bounds, window)
    (ref * dout.double()).sum().backward()

    def sh(t):
        return striped_sp.shard(t, WORLD, rank, layout=layout, cu_seqlens=bounds)

    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    kwargs = {"ulysses_size": u}
    if explicit == "pure":  # pure Ulysses as Megatron's --cp-comm-type a2a gives it: no ring group
        kwargs = {"ulysses_groups": (dist.group.WORLD, None)}
    elif explicit:
        kwargs = {"ulysses_groups": striped_sp.ulysses_ring_groups([list(range(WORLD))], u)}
    out = striped_sp.ring_attention(ql, kl, vl, layout=layout, softmax_scale=SCALE, window_size=window,
                                    cu_seqlens=None if bounds is None else torch.tensor(bounds), **kwargs)
    assert out.dtype == dtype and out.shape == ql.shape
    (out * sh(dout)).sum().backward()
    errs = sharded_errors(out, (ql, kl, vl), ref, (qr, kr, vr), sh)
    bad = {name: e for name, e in errs.items() if not e < TOL[dtype]}
    assert not bad, f"seed={seed} u={u} layout={layout} heads={heads}: errors above {TOL[dtype]}: {bad}"


def check_bad_input(seed):
    """Every rank raises ValueError naming the rule, before any message."""
    q = torch.randn(1, 8, 6, 16)
    kv = torch.randn(1, 8, 3, 16)
    with pytest.raises(ValueError, match="must divide the context-parallel size 4"):
        striped_sp.ring_attention(q, kv, kv, ulysses_size=3)
    with pytest.raises(ValueError, match="must divide the query heads"):
        striped_sp.ring_attention(q, kv, kv, ulysses_size=4)
    with pytest.raises(ValueError, match="kv heads .3. must divide by ulysses_size=2 or divide it"):
        striped_sp.ring_attention(q, kv, kv, ulysses_size=2)
    inner, outer = striped_sp.ulysses_ring_groups([list(range(WORLD))], 2)
    with pytest.raises(ValueError, match="ulysses_size=4 but the inner group has 2 ranks"):
        striped_sp.ring_attention(torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 16),
                                  ulysses_size=4, ulysses_groups=(inner, outer))
    import os

    os.environ["STRIPED_SP_CHECK_RANKS"] = "1"  # ranks that disagree on u all raise, nobody hangs
    try:
        x = torch.randn(1, 8, 4, 16)
        with pytest.raises(ValueError, match="different arguments"):
            striped_sp.ring_attention(x, x, x, ulysses_size=2 if dist.get_rank() == 0 else 1)
    finally:
        del os.environ["STRIPED_SP_CHECK_RANKS"]
    for bad in ((None, None), (7, None)):  # not process groups: ValueError, not AttributeError
        with pytest.raises(ValueError, match="not a process group"):
            striped_sp.ring_attention(torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 16),
                                      ulysses_groups=bad)
    with pytest.raises(ValueError, match="ulysses_size=True must be a positive int"):
        striped_sp.ring_attention(q, kv, kv, ulysses_size=True)
    swapped = (outer, inner)  # the ring's group passed as the Ulysses one: not the mapping
    with pytest.raises(ValueError, match="do not follow the mapping"):
        striped_sp.ring_attention(torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 16), torch.randn(1, 8, 4, 16),
                                  ulysses_groups=swapped)
    dist.barrier()


def _cases():
    cases = []
    for u in (2, 4, 1):
        for layout in ("striped", "zigzag", "contiguous"):
            cases.append((f"u{u}-{layout}-gqa-fp32", check_hierarchical, (u, layout, "gqa", torch.float32, SEED)))
    for heads in ("mha", "mqa"):
        cases.append((f"u2-striped-{heads}-fp32", check_hierarchical, (2, "striped", heads, torch.float32, SEED + 1)))
    cases.append(("u4-striped-mqa-bf16", check_hierarchical, (4, "striped", "mqa", torch.bfloat16, SEED + 2)))
    cases.append(("u2-zigzag-mha-bf16", check_hierarchical, (2, "zigzag", "mha", torch.bfloat16, SEED + 3)))
    docs = [0, 13, 14, 17, 29, 32]  # documents of 13, 1, 3, 12, 3 tokens
    cases.append(("u2-striped-docs-window", check_hierarchical,
                  (2, "striped", "gqa", torch.float32, SEED + 4, docs, (4, 0))))
    cases.append(("u2-contiguous-docs", check_hierarchical, (2, "contiguous", "mqa", torch.float32, SEED + 5, docs)))
    cases.append(("u2-zigzag-docs", check_hierarchical,
                  (2, "zigzag", "gqa", torch.float32, SEED + 6, [0, 8, 24, 32])))
    cases.append(("u4-striped-window", check_hierarchical, (4, "striped", "gqa", torch.float32, SEED + 7, None, (5, 0))))
    cases.append(("u2-striped-explicit-groups", check_hierarchical,
                  (2, "striped", "gqa", torch.float32, SEED + 8, None, None, True)))
    cases.append(("u4-zigzag-pure-ulysses-groups", check_hierarchical,
                  (4, "zigzag", "gqa", torch.float32, SEED + 10, None, None, "pure")))
    # pure Ulysses on packed rows: the gathered row in natural order, the documents as given
    cases.append(("u4-striped-docs-window", check_hierarchical,
                  (4, "striped", "gqa", torch.float32, SEED + 11, docs, (4, 0))))
    cases.append(("u4-zigzag-docs", check_hierarchical, (4, "zigzag", "mha", torch.float32, SEED + 12, [0, 8, 24, 32])))
    cases.append(("bad-input", check_bad_input, (SEED + 9,)))
    return cases


CASES = _cases()
_results = {}


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_hierarchical_on_4_ranks(name):
    if not _results:
        _results.update(run_cases(WORLD, CASES))
    assert _results[name] is None, _results[name]
