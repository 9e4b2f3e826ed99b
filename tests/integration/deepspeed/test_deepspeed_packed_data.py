"""DeepSpeed adapter data path, no processes: packed rows (DataCollatorWithFlattening) and padded rows."""

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest
import torch

from striped_sp import pad_documents, unshard
from striped_sp.deepspeed import shard_batch

DOCS = [7, 1, 12, 3, 9, 2]  # uneven, some shorter than the SP size


def _flattened(lengths=DOCS, flash_kwargs=True, seed=0):
    from transformers import DataCollatorWithFlattening

    g = torch.Generator().manual_seed(seed)
    features = [{"input_ids": torch.randint(1, 50, (n,), generator=g).tolist()} for n in lengths]
    return DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)(features)


def _shift_in_docs(labels, lengths):
    """The expected targets: next label inside each document, -100 at each document's end."""
    out, start = [], 0
    for n in lengths:
        out += labels[start + 1:start + n] + [-100]
        start += n
    return out


def _gather(parts, key, cu):
    return unshard([p[key] for p in parts], dim=1, layout=parts[0]["_layout"], cu_seqlens=cu)


@pytest.mark.parametrize("layout", ["striped", "zigzag", "contiguous"])
@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("flash_kwargs", [True, False])
def test_flattened_batch_sharded_by_documents(layout, n, flash_kwargs):
    full = _flattened(flash_kwargs=flash_kwargs)
    assert full["input_ids"].shape == (1, sum(DOCS))
    pad = pad_documents([0, *torch.tensor(DOCS).cumsum(0).tolist()], n, layout)
    parts = [dict(shard_batch(full, n, r, layout), _layout=layout) for r in range(n)]
    cu = parts[0]["cu_seq_lens_q"]
    assert torch.equal(cu, pad.cu_seqlens.to(torch.int32)) and cu.dtype == torch.int32
    assert all(torch.equal(p["cu_seq_lens_k"], cu) for p in parts)
    assert parts[0]["max_length_q"] == int((pad.cu_seqlens[1:] - pad.cu_seqlens[:-1]).max())
    for p in parts:
        assert p["labels"] is p["shift_labels"] and "attention_mask" not in p
        assert p["input_ids"].shape == (1, pad.seq_len // n)
    ids = pad.unpad(_gather(parts, "input_ids", cu))
    assert torch.equal(ids, full["input_ids"])
    # RoPE positions restart in every document: written out here, not from striped_sp
    positions = pad.unpad(_gather(parts, "position_ids", cu))[0].tolist()
    assert positions == [i for length in DOCS for i in range(length)]
    targets = _gather(parts, "shift_labels", cu)
    expected = _shift_in_docs(full["labels"][0].tolist(), DOCS)
    assert pad.unpad(targets)[0].tolist() == expected
    assert int((targets != -100).sum()) == sum(t != -100 for t in expected)  # padding has no target
    assert all(int(p["num_items_in_batch"]) == sum(t != -100 for t in expected) for p in parts)


def test_labels_without_separators_never_cross_documents():
    full = _flattened()
    full["labels"] = full["input_ids"].clone()  # no -100 at the document starts
    (part,) = [shard_batch(full, 1, 0)]
    assert part["shift_labels"][0].tolist() == _shift_in_docs(full["labels"][0].tolist(), DOCS)


def test_cu_seq_lens_alone_or_with_positions():
    full = _flattened()
    only_cu = {k: v for k, v in full.items() if k != "position_ids"}
    only_pos = {k: v for k, v in full.items() if not k.startswith(("cu_", "max_"))}
    a, b, c = (shard_batch(x, 2, 1, "striped") for x in (full, only_cu, only_pos))
    for key in ("input_ids", "shift_labels", "position_ids", "cu_seq_lens_q"):
        assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key]), key


def test_padded_rows():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 50, (3, 13), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 9:] = 0
    mask[2, 4:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    full = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    for layout, n, seq in (("striped", 2, 14), ("zigzag", 2, 16), ("contiguous", 4, 16)):
        parts = [dict(shard_batch(full, n, r, layout), _layout=layout) for r in range(n)]
        assert all("cu_seq_lens_q" not in p and p["input_ids"].shape == (3, seq // n) for p in parts)
        targets = _gather(parts, "shift_labels", None)
        expected = torch.full((3, seq), -100)
        expected[:, :12] = labels[:, 1:]
        expected[0, 8:] = -100  # the last real token has no target
        expected[2, 3:] = -100
        assert torch.equal(targets, expected), layout
        assert torch.equal(_gather(parts, "position_ids", None), torch.arange(seq).expand(3, -1))
        assert int(parts[0]["num_items_in_batch"]) == int((expected != -100).sum())


def test_padded_packed_rows_are_flattened():
    # two rows, each packed from documents (position_ids restart), right-padded to one length
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 4, 0, 1, 0, 0, 0, 0]])
    mask = torch.tensor([[1] * 9 + [0] * 2, [1] * 7 + [0] * 4])
    ids = torch.arange(1, 23).view(2, 11)
    full = {"input_ids": ids, "labels": ids.clone(), "position_ids": pos, "attention_mask": mask}
    part = shard_batch(full, 1, 0, "striped")
    assert part["input_ids"][0].tolist() == list(range(1, 10)) + list(range(12, 19))
    assert part["cu_seq_lens_q"].tolist() == [0, 3, 5, 9, 14, 16]
    assert part["position_ids"][0].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 1, 2, 3, 4, 0, 1]
    assert part["shift_labels"][0].tolist() == _shift_in_docs(part["input_ids"][0].tolist(), [3, 2, 4, 5, 2])


@pytest.mark.parametrize(
    "change,words",
    [
        (lambda b: b.update(cu_seq_lens_k=torch.tensor([0, 8, 34], dtype=torch.int32)), ["cu_seq_lens_q", "cu_seq_lens_k", "differ"]),
        (lambda b: b.update(cu_seq_lens_q=torch.tensor([0, 8, 30]), cu_seq_lens_k=None), ["cu_seq_lens_q", "ends at 30", "34"]),
        (lambda b: b.update(cu_seq_lens_q=torch.tensor([0, 8, 8, 34]), cu_seq_lens_k=None), ["cu_seq_lens_q", "strictly increasing"]),
        (lambda b: b.update(cu_seq_lens_q=torch.tensor([0, 8, 34]), cu_seq_lens_k=None), ["position_ids", "cu_seq_lens_q", "same documents"]),
        (lambda b: b.update(attention_mask=torch.ones(1, 34).index_fill(1, torch.tensor([33]), 0)), ["cu_seq_lens_q", "attention_mask"]),
    ],
)
def test_packed_errors(change, words):
    batch = _flattened()
    change(batch)
    with pytest.raises(ValueError) as err:
        shard_batch(batch, 2, 0, "striped")
    for w in words:
        assert w in str(err.value), str(err.value)


@pytest.mark.parametrize("layout", ["striped", "zigzag", "striped:stripe=doc"])
def test_shard_batch_builds_the_plan_the_attention_layers_use(layout):
    from striped_sp import RingRequest
    from striped_sp.engine.plans import PLANS, host_plan_for

    PLANS.clear()
    n, rank = 2, 1
    part = shard_batch(_flattened(), n, rank, layout)
    assert PLANS.builds == 1  # this rank's host plan, built where the batch is made
    # what the HF attention asks for in every layer: the batch's cu_seq_lens on the request's layout
    request = RingRequest(None, layout=layout).derive(cu_seqlens=part["cu_seq_lens_q"])
    local = part["input_ids"].size(1)
    host_plan_for(request.layout, request._mask(local, n), True, n, rank, local)
    assert PLANS.builds == 1  # found, not built again


def test_shard_batch_in_a_loader_worker_builds_no_plan(monkeypatch):
    """In a DataLoader worker process (num_workers > 0) a plan would land in that process's cache,
    which the model never sees: none is built there (the first layer builds it, once)."""
    from striped_sp.engine.plans import PLANS

    PLANS.clear()
    monkeypatch.setattr(torch.utils.data, "get_worker_info", lambda: object())
    part = shard_batch(_flattened(), 2, 1, "striped")
    assert PLANS.builds == 0 and part["input_ids"].size(1) == 17
