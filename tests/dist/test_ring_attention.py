"""ring_attention on 1 to 4 gloo ranks against a float64 single-process reference.

Each world size is spawned once; every case runs on every rank.  Sub-groups of a 4-rank world
give N=1 (a group per rank) and N=2 on non-adjacent ranks ([0, 2] and [1, 3]), which checks that
the ring takes its neighbours' global ranks from the group.
"""

import itertools
import random

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import CaseTable, cp_group
from reference import reference_attention, rel_err

SEED = random.randrange(2**31)
LAYOUTS = ["striped", "zigzag", "contiguous"]
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (8, 1)}
DTYPES = {"float32": (torch.float32, 1e-5), "bfloat16": (torch.bfloat16, 2e-2)}

_cp_group = cp_group


def check_against_reference(n, layout, causal, heads, dtype_name, seed, local_len=None,
                            backend="auto", softmax_scale=None, batch=2, head_dim=16, seq_first=False,
                            v_head_dim=None):
    """``v_head_dim``: v's own head dim (multi-latent attention), padded or native per kernel."""
    group, rank = _cp_group(n)
    dtype, tol = DTYPES[dtype_name]
    h, kvh = HEADS[heads]
    local_len = local_len or (6 if layout == "zigzag" else 5)
    seq = local_len * n
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, h, head_dim, generator=gen).to(dtype)
    k = torch.randn(batch, seq, kvh, head_dim, generator=gen).to(dtype)
    dv = v_head_dim or head_dim
    v = torch.randn(batch, seq, kvh, dv, generator=gen).to(dtype)
    dout = torch.randn(batch, seq, h, dv, generator=gen).to(dtype)
    scale = softmax_scale or head_dim ** -0.5

    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal, scale)
    (ref * dout.double()).sum().backward()

    def sh(t):
        return striped_sp.shard(t, n, rank, layout=layout)

    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    args = (ql, kl, vl)
    if seq_first:  # Megatron's [s, b, h, d] seen through a transpose: non-contiguous inputs
        args = tuple(t.transpose(0, 1).contiguous().transpose(0, 1) for t in args)
    out = striped_sp.ring_attention(*args, group, layout=layout, causal=causal,
                                    softmax_scale=softmax_scale, backend=backend)
    assert out.dtype == dtype and out.shape == (*ql.shape[:-1], dv)
    assert out.is_contiguous()  # [b, s, h, d] whatever format the kernel ran in: callers .view() it
    (out * sh(dout)).sum().backward()
    assert kl.grad.shape == kl.shape  # kv heads are never expanded
    assert ql.grad.is_contiguous() and kl.grad.is_contiguous() and vl.grad.is_contiguous()
    errs = {
        "out": rel_err(out, sh(ref)),
        "dq": rel_err(ql.grad, sh(qr.grad)),
        "dk": rel_err(kl.grad, sh(kr.grad)),
        "dv": rel_err(vl.grad, sh(vr.grad)),
    }
    bad = {name: e for name, e in errs.items() if not e < tol}
    assert not bad, f"seed={seed}: relative errors above {tol}: {bad}"


def check_striped_attention_alias(n, seed):
    group, rank = _cp_group(n)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 4 * n, 2, 8, generator=gen) for _ in range(3))
    sh = lambda t: striped_sp.shard(t, n, rank)  # noqa: E731
    a = striped_sp.striped_attention(sh(q), sh(k), sh(v), group)
    b = striped_sp.ring_attention(sh(q), sh(k), sh(v), group, layout="striped")
    assert torch.equal(a, b)


def check_strict_block_setting(n, seed):
    """``STRIPED_SP_STRICT_BLOCK=aligned`` on the CPU op (top-left): a striped causal ring refuses
    it on every rank before any message; rings with no strict block ignore it."""
    import os

    from striped_sp.engine.step import STRICT_BLOCK_ENV

    group, rank = _cp_group(n)
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 6, 2, 8, generator=gen) for _ in range(3))
    os.environ[STRICT_BLOCK_ENV] = "aligned"
    try:
        try:
            striped_sp.ring_attention(q, k, v, group, layout="striped")
        except ValueError as e:
            assert "'aligned' (from $STRIPED_SP_STRICT_BLOCK) needs a kernel" in str(e), e
        else:
            raise AssertionError("aligned on a top-left kernel was not refused")
        for layout, causal in (("zigzag", True), ("contiguous", True), ("striped", False)):
            striped_sp.ring_attention(q, k, v, group, layout=layout, causal=causal)
        striped_sp.ring_attention(q, k, v, group, layout="striped", window_size=(3, 0))
    finally:
        del os.environ[STRICT_BLOCK_ENV]
    os.environ["STRIPED_SP_GQA_NATIVE"] = "false"
    try:  # refused by name on every rank, before the ring starts
        striped_sp.ring_attention(q, k, v, group, layout="zigzag")
    except ValueError as e:
        assert "$STRIPED_SP_GQA_NATIVE='false' must be '1'" in str(e), e
    else:
        raise AssertionError("a bad STRIPED_SP_GQA_NATIVE was not refused")
    finally:
        del os.environ["STRIPED_SP_GQA_NATIVE"]


def _cases(world):
    sizes = {4: [4, 2, 1], 3: [3]}[world]
    cases = []
    for n, layout, causal, heads, dt in itertools.product(sizes, LAYOUTS, [True, False], HEADS, DTYPES):
        name = f"N{n}-{layout}-{'causal' if causal else 'full'}-{heads}-{dt}"
        cases.append((name, check_against_reference, (n, layout, causal, heads, dt, SEED)))
    for n in sizes:
        # longer odd shards, several kernel tiles, the math backend, a custom scale
        cases.append((f"N{n}-striped-long", check_against_reference,
                      (n, "striped", True, "gqa", "float32", SEED + 1, 37)))
        cases.append((f"N{n}-zigzag-long", check_against_reference,
                      (n, "zigzag", True, "mqa", "float32", SEED + 2, 34)))
        cases.append((f"N{n}-striped-math", check_against_reference,
                      (n, "striped", True, "gqa", "float32", SEED + 3, 7, "math")))
        cases.append((f"N{n}-contiguous-scale", check_against_reference,
                      (n, "contiguous", True, "mha", "float32", SEED + 4, 5, "auto", 0.3)))
        cases.append((f"N{n}-striped-seq-first", check_against_reference,
                      (n, "striped", True, "gqa", "bfloat16", SEED + 6, 9, "auto", None, 3, 16, True)))
        cases.append((f"N{n}-alias", check_striped_attention_alias, (n, SEED + 5)))
        # multi-latent attention shapes: v head dim 8 < q/k 12 (padded on the CPU op, native on
        # math), and 20 > 12 (q and k padded)
        for layout, backend, dv, seed in (("striped", "auto", 8, 8), ("zigzag", "math", 8, 9),
                                          ("striped", "auto", 20, 10), ("contiguous", "math", 20, 11)):
            cases.append((f"N{n}-{layout}-mla-{backend}-v{dv}", check_against_reference,
                          (n, layout, True, "gqa", "float32", SEED + seed, 8 if layout == "zigzag" else 7, backend,
                           None, 2, 12, False, dv)))
        cases.append((f"N{n}-strict-block-setting", check_strict_block_setting, (n, SEED + 7)))
    return cases


CASES = CaseTable({world: _cases(world) for world in (4, 3)})


@pytest.mark.parametrize("world, name", CASES.params())
def test_against_float64_reference(world, name):
    err = CASES.result(world, name)
    assert err is None, err
