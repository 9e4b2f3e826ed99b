"""Masked block plans (packed documents, windows) reproduce the global mask; packing helpers."""

import random

import pytest
import torch

import striped_sp
from reference import reference_mask
from striped_sp.plan.layouts import get_layout
from striped_sp.plan.masks import block_plan, make_mask
from striped_sp.kernels.varlen import TILE, schedule


def _random_mask(rng, layout, n):
    unit = 2 * n if layout == "zigzag" else 1
    seq = rng.randint(1, 12) * (unit if layout == "zigzag" else 2 * n if layout == "striped:stripe=2" else n)
    cuts = sorted(rng.sample(range(1, seq // unit), rng.randint(0, seq // unit - 1))) if seq // unit > 1 else []
    bounds = [0] + [c * unit for c in cuts] + [seq]
    causal = rng.random() < 0.7
    left = rng.choice([-1, 0, 1, 2, 3, 5, 7, 20, 1000])
    right = 0 if causal else rng.choice([-1, 0, 1, 3])
    return bounds, causal, (left, right)


def _coverage(layout, n, spec):
    """How often each (query, key) pair of the global row is computed by the plans of all blocks."""
    lay = get_layout(layout)
    seq = spec.seq_len
    pos = [lay.positions(seq, n, r, spec.bounds) for r in range(n)]
    covered = torch.zeros(seq, seq, dtype=torch.int64)
    local = torch.arange(seq // n)
    for rank in range(n):
        for source in range(n):
            for call in block_plan(lay, spec, n, rank, source):
                rows, keys = local[call.q], local[call.kv]
                visible = call.segments.dense_mask()
                assert rows.unique().numel() == rows.numel(), "a query row twice in one call"
                assert visible.any(1).all(), "a row of a call sees nothing"
                assert visible.any(0).all(), "a key of a call is seen by nobody"
                assert int(visible.sum()) == call.entries
                qp = pos[rank][rows].unsqueeze(1).expand_as(visible)
                kp = pos[source][keys].unsqueeze(0).expand_as(visible)
                covered.index_put_((qp, kp), visible.long(), accumulate=True)
    return covered


@pytest.mark.parametrize("layout", ["striped", "zigzag", "contiguous", "striped:stripe=2", "striped:stripe=doc",
                                    "striped:place=auto"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_plans_cover_exactly_the_visible_entries(layout, n):
    rng = random.Random(n * 31 + len(layout))
    for _ in range(25):
        bounds, causal, window = _random_mask(rng, layout, n)
        spec = make_mask(bounds[-1], n, get_layout(layout), bounds, window, causal)
        want = reference_mask(bounds[-1], causal, bounds, window).long()
        got = _coverage(layout, n, spec)
        assert torch.equal(got, want), f"{layout} N={n} bounds={bounds} causal={causal} window={window}"


@pytest.mark.parametrize("window", [None, (5, 0), (40, 0)])
def test_striped_blocks_are_square_causal_in_two_window_classes(window):
    """Under striped every segment is a square causal band, and a block holds at most two window
    classes (inclusive and strict pieces), however many documents the row packs."""
    n, rng = 4, random.Random(7)
    lengths = [rng.randint(1, 30) for _ in range(60)]
    seq = sum(lengths) + (-sum(lengths) % n)
    bounds = [0]
    for x in lengths + ([seq - sum(lengths)] if seq > sum(lengths) else []):
        bounds.append(bounds[-1] + x)
    spec = make_mask(seq, n, get_layout("striped:stripe=1"), bounds, window, True)
    for rank in range(n):
        for source in range(n):
            calls = block_plan(get_layout("striped:stripe=1"), spec, n, rank, source)
            assert len(calls) <= 1
            for call in calls:
                segs = call.segments
                assert torch.equal(segs.lq, segs.lk) and (segs.wr == 0).all()
                assert torch.unique(segs.wl[segs.wl >= 0]).numel() <= 2


def test_packed_schedule_bounds_the_number_of_kernel_calls():
    """About 2,000 short documents in a row: a handful of batched calls per block, not one each."""
    n, seq = 8, 8 * 1024
    lengths = [1 + (i * 7919) % 63 for i in range(4000)]
    bounds = [0]
    for x in lengths:
        if bounds[-1] + x >= seq:
            break
        bounds.append(bounds[-1] + x)
    bounds.append(seq)
    spec = make_mask(seq, n, get_layout("striped:stripe=1"), bounds, None, True)
    for source in range(n):
        for call in block_plan(get_layout("striped:stripe=1"), spec, n, 3, source):
            plan = schedule(call.segments)
            assert len(plan.direct) + len(plan.batches) <= 6
            for pack in plan.batches:
                assert pack.cq <= 2 * TILE


@pytest.mark.parametrize("layout", ["striped", "zigzag", "contiguous"])
def test_shard_unshard_and_document_positions(layout):
    n = 3
    raw = [0, 5, 6, 13, 20]
    pad = striped_sp.pad_documents(raw, n, layout=layout)
    bounds = pad.cu_seqlens.tolist()
    seq = pad.seq_len
    assert seq % n == 0
    if layout == "zigzag":
        assert all((b - a) % (2 * n) == 0 for a, b in zip(bounds[:-1], bounds[1:]))
        assert pad.padding_tokens == sum(-(b - a) % (2 * n) for a, b in zip(raw[:-1], raw[1:]))
    else:
        assert pad.padding_tokens == -20 % n
    x = torch.randn(1, 20, 2)
    padded = pad.pad(x)
    assert torch.equal(pad.unpad(padded), x)
    shards = [striped_sp.shard(padded, n, r, layout=layout, cu_seqlens=pad.cu_seqlens) for r in range(n)]
    assert all(torch.equal(pad.shard(x, r), shards[r]) for r in range(n))
    assert torch.equal(striped_sp.unshard(shards, layout=layout, cu_seqlens=pad.cu_seqlens), padded)
    # RoPE positions inside documents, against an independent per-token table
    starts = torch.tensor(bounds[:-1])
    doc = torch.searchsorted(torch.tensor(bounds[1:]), torch.arange(seq), right=True)
    in_doc = (torch.arange(seq) - starts[doc]).view(1, seq)
    for r in range(n):
        want = striped_sp.shard(in_doc, n, r, layout=layout, cu_seqlens=pad.cu_seqlens).flatten()
        assert torch.equal(striped_sp.document_positions(seq, n, r, layout, pad.cu_seqlens), want)


def test_zigzag_packed_positions_follow_transformer_engine():
    """Each document is cut into 2N chunks; rank r holds chunks r and 2N-1-r of every document."""
    pos = striped_sp.positions(16, 2, 0, "zigzag", cu_seqlens=[0, 8, 16])
    assert pos.tolist() == [0, 1, 6, 7, 8, 9, 14, 15]
    pos = striped_sp.positions(16, 2, 1, "zigzag", cu_seqlens=[0, 8, 16])
    assert pos.tolist() == [2, 3, 4, 5, 10, 11, 12, 13]


def test_shard_refuses_a_row_that_does_not_divide():
    with pytest.raises(ValueError, match="sequence length 10 must be a positive multiple of world_size = 4"):
        striped_sp.shard(torch.zeros(1, 10), 4, 0, cu_seqlens=[0, 3, 10])
    with pytest.raises(ValueError, match="under layout 'zigzag' every document must be a multiple of"):
        striped_sp.shard(torch.zeros(1, 8), 2, 0, layout="zigzag", cu_seqlens=[0, 2, 8])
