"""Packed documents and sliding windows: ring_attention on 1 to 4 gloo ranks against a float64
single-process reference with the same mask (forward and gradients), for every layout."""

import random

import pytest
import torch

import striped_sp
from dist_helper import CaseTable, cp_group
from reference import reference_attention, sharded_errors
from seeds import seed_for

SEED = seed_for(__name__)  # fixed (tests/support/seeds.py): the same in every spawned rank
SCALE = 0.3  # not the default head_dim ** -0.5 = 0.25 (head_dim 16): a dropped scale fails
HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (8, 1)}
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _err(x, ref):
    # relative to max(1, |ref|): a window of 0 makes some reference gradients exactly zero
    return ((x.double() - ref.double()).abs().max() / max(1.0, ref.double().abs().max().item())).item()


def _doc_lengths(rng, n, layout, total, short):
    """Random document lengths summing to ``total``: with ``short``, documents shorter than ``n``
    and one of length 1 among them (zigzag: multiples of 2n)."""
    unit = 2 * n if layout == "zigzag" else 1
    units = total // unit
    lengths = []
    while units > 0:
        pick = 1 if short and rng.random() < 0.5 else rng.randint(1, max(1, units // 2))
        pick = min(pick, units)
        lengths.append(pick * unit)
        units -= pick
    if short and layout != "zigzag" and 1 not in lengths:
        lengths[-1] -= 1
        lengths.append(1)
        lengths = [x for x in lengths if x > 0]
    return lengths


def _bounds(lengths):
    out = [0]
    for x in lengths:
        out.append(out[-1] + x)
    return out


def check_masked(n, layout, heads, dtype, seed, local_len, docs, window, causal=True, backend="auto", batch=1):
    """``docs``: None, "short" (many short documents) or "mixed"; ``window``: None or (left, right);
    ``batch`` > 1 only without documents."""
    group, rank = cp_group(n)
    rng = random.Random(seed)
    seq = local_len * n
    bounds = None if docs is None else _bounds(_doc_lengths(rng, n, layout, seq, docs == "short"))
    h, kvh = HEADS[heads]
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seq, h, 16, generator=gen).to(dtype)
    k = torch.randn(batch, seq, kvh, 16, generator=gen).to(dtype)
    v = torch.randn(batch, seq, kvh, 16, generator=gen).to(dtype)
    dout = torch.randn(batch, seq, h, 16, generator=gen).to(dtype)
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, causal, SCALE, bounds, window)
    (ref * dout.double()).sum().backward()

    def sh(t):
        return striped_sp.shard(t, n, rank, layout=layout, cu_seqlens=bounds)

    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    cu = None if bounds is None else torch.tensor(bounds, dtype=torch.int32)
    out = striped_sp.ring_attention(ql, kl, vl, group, layout=layout, causal=causal, softmax_scale=SCALE,
                                    backend=backend, cu_seqlens=cu, window_size=window)
    assert out.dtype == dtype and out.shape == ql.shape
    (out * sh(dout)).sum().backward()
    errs = sharded_errors(out, (ql, kl, vl), ref, (qr, kr, vr), sh)
    bad = {name: e for name, e in errs.items() if not e < TOL[dtype]}
    assert not bad, f"seed={seed} bounds={bounds} window={window}: errors above {TOL[dtype]}: {bad}"


def check_zigzag_padded(n, seed):
    """Transformer Engine's zigzag rule through pad_documents: outputs and gradients of the real
    tokens equal the reference on the unpadded row."""
    group, rank = cp_group(n)
    rng = random.Random(seed)
    lengths = [rng.randint(1, 3 * n) for _ in range(5)] + [1]
    bounds = _bounds(lengths)
    seq = bounds[-1]
    gen = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(1, seq, 4, 16, generator=gen) for _ in range(4))
    qr, kr, vr = (t.double().requires_grad_() for t in (q, k, v))
    ref = reference_attention(qr, kr, vr, True, SCALE, bounds, (5, 0))
    (ref * dout.double()).sum().backward()
    pad = striped_sp.pad_documents(bounds, n, layout="zigzag")
    assert pad.padding_tokens == pad.seq_len - seq > 0

    def sh(t):
        return striped_sp.shard(pad.pad(t), n, rank, layout="zigzag", cu_seqlens=pad.cu_seqlens)

    ql, kl, vl = (sh(t).requires_grad_() for t in (q, k, v))
    out = striped_sp.ring_attention(ql, kl, vl, group, layout="zigzag", softmax_scale=SCALE,
                                    cu_seqlens=pad.cu_seqlens, window_size=(5, 0))
    (out * sh(dout)).sum().backward()  # padded rows of dout are zero
    real = sh(torch.ones(1, seq, 1, 1)).flatten().bool()  # this rank's real tokens
    for got, want in ((out, ref), (ql.grad, qr.grad), (kl.grad, kr.grad), (vl.grad, vr.grad)):
        assert _err(got[:, real], sh(want.detach())[:, real]) < 1e-5


def _cases(world):
    sizes = {4: [4, 2, 1], 3: [3]}[world]
    cases = []
    for n in sizes:
        big = max(1, 8 // n)  # a window wider than the whole row
        for i, layout in enumerate(["striped", "zigzag", "contiguous"]):
            s = SEED + 100 * n + 10 * i
            ll = 8 if layout == "zigzag" else 7
            specs = [
                ("docs-short", "gqa", torch.float32, ll, "short", None, True, "auto"),
                ("docs-mixed-bf16", "mqa", torch.bfloat16, 2 * ll, "mixed", None, True, "auto"),
                ("window-lt-N", "mha", torch.float32, ll, None, (1, 0), True, "auto"),
                ("window-gt-row", "gqa", torch.bfloat16, ll, None, (1000 * big, 0), True, "auto"),
                ("docs-window", "gqa", torch.float32, 2 * ll, "short", (3, 0), True, "auto"),
                ("docs-window-zero", "mha", torch.float32, ll, "mixed", (0, 0), True, "auto"),
                ("docs-window-bf16", "mqa", torch.bfloat16, 2 * ll, "mixed", (5, 0), True, "auto"),
                ("docs-window-noncausal", "gqa", torch.float32, ll, "mixed", (3, 2), False, "auto"),
                ("docs-noncausal", "mha", torch.float32, ll, "short", None, False, "auto"),
                ("docs-window-math", "gqa", torch.float32, ll, "mixed", (4, 0), True, "math"),
                # several tiles, direct calls and packs of every size class
                ("long-docs-window", "gqa", torch.float32, 300, "mixed", (150, 0), True, "auto"),
                ("long-docs", "mqa", torch.float32, 300, "mixed", None, True, "auto"),
                ("long-window-bf16", "gqa", torch.bfloat16, 300, None, (150, 0), True, "auto"),
            ]
            for j, (name, heads, dtype, local_len, docs, window, causal, backend) in enumerate(specs):
                cases.append((f"N{n}-{layout}-{name}", check_masked,
                              (n, layout, heads, dtype, s + j, local_len, docs, window, causal, backend)))
            cases.append((f"N{n}-{layout}-window-batch3", check_masked,
                          (n, layout, "gqa", torch.float32, s + 50, 3 * ll, None, (4, 0), True, "auto", 3)))
        cases.append((f"N{n}-zigzag-padded", check_zigzag_padded, (n, SEED + n)))
    return cases


def _release(world, name):
    """The multi-tile rows (``long-*``, two thirds of the grid's time) of zigzag and contiguous run in
    make test-release; striped's run in make test at every N."""
    return "-long-" in name and "-striped-" not in name


CASES = CaseTable({world: _cases(world) for world in (4, 3)}, release=_release)


@pytest.mark.parametrize("world, name", CASES.params())
def test_masked_against_float64_reference(world, name):
    err = CASES.result(world, name)
    assert err is None, err
