"""A packed row must be sharded with its documents where the layout places tokens by them (issue 46, item 1).

Under the default ``striped`` (the per-batch search) and ``zigzag``, which tokens a rank holds depends
on ``cu_seqlens``: ``shard(t, n, rank)`` followed by ``ring_attention(..., cu_seqlens=cu)`` used to
compute a wrong result silently.  Now every rank raises a ``ValueError`` naming the layout, the rule
and the fix before the ring sends anything; the right pattern, and layouts whose placement ignores
the documents, stay exact against a float64 reference that does not run the engine."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import striped_sp
from case_tests import cases_test
from reference import reference_attention
from seeds import seed_for

SEED = seed_for(__name__)  # the same in every spawned rank
N, S = 2, 48
REFUSED = (r"layout '{}' places the tokens of a packed row by its documents.*"
           r"striped_sp\.shard\(t, n, rank, layout='{}', cu_seqlens=cu\)")


def _full(seed, s=S, h=4, kvh=2, d=8):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, s, heads, d, generator=gen, dtype=torch.float64) for heads in (h, kvh, kvh, h)]


class _RingMessages:
    """Counts the ring's batched sends and receives while active."""

    def __enter__(self):
        self.calls, self._real = 0, dist.batch_isend_irecv

        def counting(ops):
            self.calls += 1
            return self._real(ops)

        dist.batch_isend_irecv = counting
        return self

    def __exit__(self, *exc):
        dist.batch_isend_irecv = self._real


def _exact(layout, bounds, shard_bounds, seed, **kwargs):
    """Output and gradients of the ring on inputs sharded with ``shard_bounds`` against float64."""
    rank = dist.get_rank()
    q, k, v, dout = _full(seed, bounds[-1])
    sh = lambda t: striped_sp.shard(t, N, rank, layout=layout, cu_seqlens=shard_bounds)  # noqa: E731
    local = [sh(t).requires_grad_() for t in (q, k, v)]
    out = striped_sp.ring_attention(*local, layout=layout, cu_seqlens=torch.tensor(bounds), **kwargs)
    (out * sh(dout)).sum().backward()  # not out.backward(grad): that imports sympy (seconds per rank)
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*full, True, 8 ** -0.5, bounds)
    (ref * dout).sum().backward()
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in local)),
                               (ref, *(t.grad for t in full))):
        err = ((got - sh(want)).abs().max() / want.abs().max()).item()
        assert err < 1e-10, f"{layout} {bounds}: {name} off by {err:.2e}"


def check_dense_shard_refused(layout, bounds, checks):
    """The old pattern, each layout that places documents: a ValueError on every rank naming the
    layout and the fix, no ring message sent, with the ranks' check on or off; likewise through a
    ``RingRequest`` derived per batch."""
    rank = dist.get_rank()
    q, k, v, _ = _full(SEED)
    local = [striped_sp.shard(t, N, rank, layout=layout) for t in (q, k, v)]  # no cu_seqlens: the dense shard
    saved = os.environ.get("STRIPED_SP_CHECK_RANKS")
    os.environ["STRIPED_SP_CHECK_RANKS"] = checks
    try:
        with _RingMessages() as sent:
            with pytest.raises(ValueError, match=REFUSED.format(layout, layout)):
                striped_sp.ring_attention(*local, layout=layout, cu_seqlens=torch.tensor(bounds))
            request = striped_sp.RingRequest(layout=layout).derive(cu_seqlens=bounds)
            with pytest.raises(ValueError, match="sharded_by_documents=True"):
                request(*local)
        assert sent.calls == 0, f"the ring sent {sent.calls} batches before the refusal"
    finally:
        if saved is None:
            os.environ.pop("STRIPED_SP_CHECK_RANKS")
        else:
            os.environ["STRIPED_SP_CHECK_RANKS"] = saved


def check_documents_shard_exact(layout, bounds):
    """The right pattern: shard with the documents, then ring_attention with them: exact."""
    _exact(layout, bounds, bounds, SEED + 1)


def check_one_rank_dense():
    """Rank 0 sharded with the documents, rank 1 without: every rank raises, naming the field."""
    rank = dist.get_rank()
    bounds = [0, 9, 10, 31, S]
    q, k, v, _ = _full(SEED + 2)
    local = [striped_sp.shard(t, N, rank, cu_seqlens=bounds if rank == 0 else None) for t in (q, k, v)]
    with _RingMessages() as sent:
        with pytest.raises(ValueError, match="rank 1 passed sharded by documents=False, rank 0 passed True"):
            striped_sp.ring_attention(*local, cu_seqlens=bounds)
    assert sent.calls == 0


def check_placement_free_layouts_keep_the_dense_shard():
    """Where the documents move no token (stripes of 1 pinned, contiguous, one document under the
    default) a dense shard is the right one and still runs, exact."""
    for layout, bounds in (("striped:stripe=1", [0, 7, 19, 30, S]), ("contiguous", [0, 7, 19, 30, S]),
                           ("striped", [0, S])):
        _exact(layout, bounds, None, SEED + 3)


def check_declared():
    """Rows sharded by their documents without ``shard`` (the index of ``positions``, as a loader
    worker would): ``sharded_by_documents=True`` runs them, exact."""
    rank = dist.get_rank()
    bounds = [0, 4, 23, 24, 40, S]
    q, k, v, dout = _full(SEED + 4)
    idx = striped_sp.positions(S, N, rank, cu_seqlens=bounds)
    local = [t.index_select(1, idx).requires_grad_() for t in (q, k, v)]
    with pytest.raises(ValueError, match="sharded_by_documents=True"):
        striped_sp.ring_attention(*local, cu_seqlens=bounds)
    out = striped_sp.ring_attention(*local, cu_seqlens=bounds, sharded_by_documents=True)
    ref = reference_attention(q, k, v, True, 8 ** -0.5, bounds)
    assert ((out - ref.index_select(1, idx)).abs().max() / ref.abs().max()).item() < 1e-10


#: rows of one, two and four documents (each a multiple of 2N, as zigzag needs): (name, bounds)
_ROWS = (("one", [0, S]), ("two", [0, 20, S]), ("four", [0, 8, 16, 36, S]))  # rows no other case shards
#: every layout form: layout -> the rows whose documents move tokens there (their dense shard holds other
#: tokens than the documents' one), from the layouts' definitions: the default's search and per-document
#: stripes place every row of two or more documents; whole placement of documents up to 8 tokens moves the
#: row with documents of 8 and not the one of 20 and 28 (each dealt in stripes of 1, as the dense row);
#: pinned stripes and contiguous chunks ignore the documents
_MOVES = {"striped": ("two", "four"), "striped:stripe=1": (), "striped:stripe=2": (),
          "striped:stripe=doc": ("two", "four"), "striped:place=8": ("four",), "striped:place=24": ("two", "four"),
          "zigzag": ("two", "four"), "contiguous": ()}


def check_rows_of_every_size(layout):
    """Rows of one, two and four documents under ``layout``: sharded with the documents, exact against
    float64; sharded densely, refused (no ring message) where the documents move tokens, else exact too
    (a dense shard is never run silently wrong, whatever the number of documents)."""
    for i, (name, bounds) in enumerate(_ROWS):  # the dense shard first: no shard of the row recorded yet
        if name in _MOVES[layout]:
            check_dense_shard_refused(layout, bounds, "1")
        else:
            _exact(layout, bounds, None, SEED + 20 + i)
        _exact(layout, bounds, bounds, SEED + 10 + i)


_ZIGZAG = [0, 8, 16, 40, S]  # every document a multiple of 2N
CASES = [
    ("dense-striped", check_dense_shard_refused, ("striped", [0, 7, 19, 30, S], "1")),
    ("dense-striped-unchecked", check_dense_shard_refused, ("striped", [0, 5, 21, 33, S], "0")),
    ("dense-doc-stripes", check_dense_shard_refused, ("striped:stripe=doc", [0, 11, 20, S], "1")),
    ("dense-zigzag", check_dense_shard_refused, ("zigzag", _ZIGZAG, "1")),
    ("documents-striped", check_documents_shard_exact, ("striped", [0, 7, 19, 30, S])),
    ("documents-zigzag", check_documents_shard_exact, ("zigzag", _ZIGZAG)),
    ("one-rank-dense", check_one_rank_dense, ()),
    ("placement-free", check_placement_free_layouts_keep_the_dense_shard, ()),
    ("declared", check_declared, ()),
    *((f"rows-{layout}", check_rows_of_every_size, (layout,)) for layout in _MOVES),
]
test_packed_row_sharding = cases_test(N, CASES)
