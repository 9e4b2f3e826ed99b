"""plan/sharded_rows.py: which layouts move a packed row's tokens with its documents, and the record
``shard(..., cu_seqlens=)`` leaves for the ring's check (issue 46, item 1; the ring itself:
tests/dist/test_shard_documents.py)."""

from __future__ import annotations

import pytest
import torch

import striped_sp
from striped_sp.plan.sharded_rows import documents_move_tokens, sharding_error, sharding_state

S, N = 60, 3
ROW = (0, 7, 26, 27, 41, S)  # documents of 7, 19, 1, 14 and 19 tokens


@pytest.mark.parametrize("layout, bounds, moves", [
    ("striped", ROW, True),  # the default: the per-batch search places the row
    ("striped:stripe=doc", ROW, True),
    ("striped:place=8", ROW, True),
    ("zigzag", (0, 12, 18, S), True),  # per-document chunks
    # rows of two documents: moved like longer rows where the layout places them
    ("striped", (0, 18, S), True),
    ("striped:stripe=doc", (0, 24, S), True),
    ("striped:place=30", (0, 12, S), True),  # the document of 12 whole on one rank
    ("zigzag", (0, 24, S), True),
    ("striped:stripe=2", (0, 24, S), False),
    ("contiguous", (0, 24, S), False),
    ("striped", (0, S), False),  # one document: the dense placement
    ("zigzag", (0, S), False),
    ("striped:stripe=1", ROW, False),  # pinned stripes: the documents move nothing
    ("striped:stripe=4", ROW, False),
    ("contiguous", ROW, False),
])
def test_which_layouts_move_tokens(layout, bounds, moves):
    lay = striped_sp.get_layout(layout)
    assert documents_move_tokens(lay, S, N, bounds) is moves
    differs = any(not torch.equal(striped_sp.positions(S, N, r, layout, cu_seqlens=list(bounds)),
                                  striped_sp.positions(S, N, r, layout)) for r in range(N))
    assert differs is moves


def test_shard_with_the_documents_is_recorded():
    lay = striped_sp.get_layout("striped")
    row = (0, 3, 29, 30, 52, S)  # a row no other test shards
    x = torch.arange(S).view(1, S, 1)
    assert sharding_state(lay, S, N, row, False) is False
    striped_sp.shard(x, N, 1, layout="striped")  # the dense shard records nothing
    assert sharding_state(lay, S, N, row, False) is False
    assert sharding_state(lay, S, N, row, True) is None  # declared by the caller: nothing to check
    striped_sp.shard(x, N, 1, layout="striped", cu_seqlens=torch.tensor(row))
    assert sharding_state(lay, S, N, row, False) is True
    assert sharding_state(lay, S, 2 * N, row, False) is False  # another ring size: another placement
    assert sharding_state(striped_sp.get_layout("striped:stripe=doc"), S, N, row, False) is False
    assert sharding_state(lay, S, N, None, False) is None
    assert sharding_state(striped_sp.get_layout("contiguous"), S, N, row, False) is None


def test_padded_documents_shard_is_recorded():
    pad = striped_sp.pad_documents([0, 5, 17, 31], N, "zigzag")
    pad.shard(torch.zeros(1, 31), 0)
    assert sharding_state(striped_sp.get_layout("zigzag"), pad.seq_len, N, tuple(pad.cu_seqlens.tolist()), False)


def test_the_message_names_layout_rule_and_fix():
    lay = striped_sp.get_layout("striped:stripe=doc")
    text = sharding_error("ring_attention", lay, S, N, ROW)
    for part in ("layout 'striped:stripe=doc' places the tokens of a packed row by its documents",
                 "5 documents, 60 tokens on 3 ranks", "striped_sp.shard(t, n, rank)) hold other tokens",
                 "striped_sp.shard(t, n, rank, layout='striped:stripe=doc', cu_seqlens=cu)",
                 "sharded_by_documents=True", "layout='striped:stripe=1'"):
        assert part in text, part
