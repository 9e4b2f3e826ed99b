"""The compile-time layering of a scheduled call against references written with Python sets:
direct pieces into layers (:func:`~striped_sp.kernels.direct.direct_layers`), batches into merge
layers (``varlen._assign``), and the padding slots / real rows the batch builders derive for all
batches at once (against their definition from ``q_real``)."""

from __future__ import annotations

import random
import types

import pytest
import torch

from striped_sp.kernels import varlen
from striped_sp.kernels.direct import direct_layers
from striped_sp.kernels.schedule import Direct, schedule_steps
from striped_sp.kernels.segments import Segments


def _first_fit_pieces(pieces):
    """Reference: pieces in (q0, k0) order, each into the first layer none of whose pieces has
    one of its query rows; inside a layer (in query order) a piece shares the key split when no
    earlier piece of the layer has one of its key rows."""
    layers = []
    for p in sorted(pieces, key=lambda p: (p.q0, p.k0)):
        rows = set(range(p.q0, p.q1))
        for layer in layers:
            if not rows & layer[0]:
                break
        else:
            layer = [set(), []]
            layers.append(layer)
        layer[0] |= rows
        layer[1].append((p.q0, p.q1, p.k0, p.k1, p.causal))
    out = []
    for _, found in layers:
        found.sort()
        keys, shared = set(), []
        for _, _, c, d, _ in found:
            own = set(range(c, d))
            shared.append(not own & keys)
            if shared[-1]:
                keys |= own
        out.append((tuple(found), tuple(shared)))
    return out


def _random_pieces(rng, disjoint: bool, n: int = 12):
    pieces, at = [], 0
    for _ in range(n):
        a = at + rng.randrange(0, 4) if disjoint else rng.randrange(0, 60)
        m = rng.randrange(1, 9)
        c = rng.randrange(0, 60) if rng.random() < 0.5 else a
        pieces.append(Direct(a, a + m, c, c + (m if rng.random() < 0.5 else rng.randrange(1, 9)), rng.random() < 0.3))
        at = a + m
    return pieces


@pytest.mark.parametrize("disjoint", [True, False], ids=["disjoint-rows", "shared-rows"])
def test_direct_layers_match_first_fit(disjoint):
    rng = random.Random(3)
    for _ in range(200):
        pieces = _random_pieces(rng, disjoint)
        layers = direct_layers(pieces)
        ref = _first_fit_pieces(pieces)
        assert [(layer.pieces, tuple(j >= 0 for j in layer.k_chunk)) for layer in layers] == ref
        for layer in layers:  # the split: each piece's chunk is exactly its rows
            q_at = [0]
            for size in layer.q_sizes:
                q_at.append(q_at[-1] + size)
            for (a, b, c, d, _), i, j in zip(layer.pieces, layer.q_chunk, layer.k_chunk):
                assert (q_at[i], q_at[i + 1]) == (a, b)
                if j >= 0:
                    k_at = sum(layer.k_sizes[:j])
                    assert (k_at, k_at + layer.k_sizes[j]) == (c, d)


def _first_fit_batches(taken, rows_of, alone, nq):
    """Reference of ``varlen._assign``: each batch into the first layer none of whose rows it
    has (an ``alone`` batch into a new layer that is taken whole)."""
    taken = [set(t.nonzero().flatten().tolist()) for t in taken]
    members = [[] for _ in taken]
    for j, (rows, own) in enumerate(zip(rows_of, alone)):
        rows = set(rows.tolist())
        for i, occ in enumerate(taken):
            if not own and not rows & occ:
                break
        else:
            i = len(taken)
            taken.append(set(range(nq)) if own else set())
            members.append([])
        taken[i] |= rows
        members[i].append(j)
    return members


@pytest.mark.parametrize("case", ["disjoint", "clash-with-direct", "clash-between-batches", "alone", "no-direct"])
def test_batches_join_merge_layers_first_fit(case):
    rng = random.Random(hash(case) % 1000)
    nq = 300
    for _ in range(100):
        perm = torch.randperm(nq, generator=torch.Generator().manual_seed(rng.randrange(10**6)))
        direct_rows = [] if case == "no-direct" else [perm[:80]]
        rest = perm[80:]
        rows_of, at = [], 0
        for _ in range(rng.randrange(1, 6)):
            n = rng.randrange(1, 30)
            rows_of.append(rest[at:at + n])
            at += n
        if case == "clash-with-direct":
            rows_of[rng.randrange(len(rows_of))] = torch.cat([rows_of[-1], perm[rng.randrange(80):][:1]])
        if case == "clash-between-batches":
            rows_of.append(rows_of[0][:3].clone())
        srcs = [types.SimpleNamespace(strided=None, packs=1, cq=r.numel(), group=-1) for r in rows_of]
        alone = [False] * len(srcs)
        if case == "alone":
            j = rng.randrange(len(srcs))
            srcs[j] = types.SimpleNamespace(strided=(0, 0, 1), packs=1, cq=varlen.SPAN_ROWS, group=-1)
            alone[j] = True
        taken = []
        for rows in direct_rows:
            occ = torch.zeros(nq, dtype=torch.bool)
            occ[rows] = True
            taken.append(occ)
        ref = _first_fit_batches([t.clone() for t in taken], rows_of, alone, nq)
        assert varlen._assign(taken, rows_of, srcs, nq) == ref


def _random_calls(rng, calls: int = 4):
    """Calls of band segments (keys at least as many as queries: every row sees a key)."""
    out = []
    for _ in range(calls):
        lq = [rng.choice([1, 3, 8, 15, 16, 17, 24, 31, 32, 40, 64, 100, 128, 200]) for _ in range(rng.randrange(3, 30))]
        lk = [m if rng.random() < 0.6 else m + rng.choice([1, 5, 64]) for m in lq]
        wl = [-1 if rng.random() < 0.6 else rng.randrange(0, 300) for _ in lq]
        wr = [0 if rng.random() < 0.8 else rng.choice([-1, 5]) for _ in lq]
        cu = lambda xs: torch.tensor([0] + xs).cumsum(0)
        out.append(Segments(cu(lq), cu(lk), torch.tensor(wl), torch.tensor(wr)))
    return out


def test_builders_padding_slots_and_rows_follow_q_real():
    rng = random.Random(5)
    seen = {"padded": 0, "whole": 0}
    for _ in range(40):
        for sched in schedule_steps(_random_calls(rng)):
            for p in sched.batches:
                if p.q_real is None:
                    assert p.q_pad is None
                    assert torch.equal(p.real_rows(), p.q_index)
                    seen["whole"] += 1
                    continue
                keep = torch.ones(p.packs * p.cq, dtype=torch.bool)
                keep[p.q_real] = False
                assert torch.equal(p.q_pad, keep.nonzero().flatten())
                assert torch.equal(p.real_rows(), p.q_index[p.q_real])
                seen["padded"] += 1
    assert seen["padded"] > 20 and seen["whole"] > 20


def test_batches_of_one_group_share_no_row_nor_a_direct_pieces():
    """What lets ``varlen._assign`` put batches of one schedule group into the first merge layer
    unchecked: their rows are distinct, and for narrow tiles and dense middles distinct from every
    direct piece's (an edge's rows are those of its tile's middle, which may be a direct piece)."""
    rng = random.Random(8)
    groups_seen = set()
    for _ in range(40):
        for sched in schedule_steps(_random_calls(rng)):
            direct = set()
            for p in sched.direct:
                direct |= set(range(p.q0, p.q1))
            by_group = {}
            for p in sched.batches:
                assert p.group in (0, 1, 2, 3)
                rows = p.real_rows().tolist()
                assert len(set(rows)) == len(rows)
                seen = by_group.setdefault(p.group, set())
                assert not seen & set(rows)
                if p.group in (0, 3):
                    assert not direct & set(rows)
                seen |= set(rows)
            groups_seen |= set(by_group)
    assert groups_seen == {0, 1, 2, 3}
