"""The ring request (striped_sp/request.py): built once, called with q/k/v only, exact against the
float64 reference; its checks run once per shape / per batch; the agreement helpers; the layout
facts and the one algo table the adapters use; the kernels package has no import circle."""

import ast
import pathlib

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import check_case, run_cases
from reference import reference_attention, sharded_errors
from seeds import seed_for
from striped_sp.engine import agreement, request as request_mod
from striped_sp.plan.layouts import ALGOS, LAYOUTS, get_layout, positions
from striped_sp.engine.request import RingRequest, window_of

SEED = seed_for(__name__)
WORLD = 2
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _inputs(seq, seed, h=4, kvh=2, d=8):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, seq, heads, d, generator=gen, dtype=torch.float64) * 0.7 for heads in (h, kvh, kvh)]


def _run(request, full, layout, cu_seqlens=None):
    """One call of ``request`` on this rank's shards of ``full`` (q, k, v, dout); errors vs the
    float64 reference of the whole sequence."""
    n, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, do = full
    shard = lambda t: striped_sp.shard(t, n, rank, layout=layout, cu_seqlens=cu_seqlens)  # noqa: E731
    local = [shard(t).detach().requires_grad_() for t in (q, k, v)]
    out = request(*local)
    out.backward(shard(do))
    window = request.window
    ref_in = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref = reference_attention(*ref_in, request.causal, q.size(-1) ** -0.5, cu_seqlens, window)
    ref.backward(do)
    return sharded_errors(out, local, ref, ref_in, shard)


def check_built_once_called_many(layout):
    """One request, three batches of fresh inputs, then the same request with a batch's documents
    and with another window: exact each time; the kernel is resolved and the mask built once per
    shape, and an agreed request sends nothing more."""
    seq = 2 * 3 * 10  # 60 tokens: 30 per rank, fits zigzag (2N) and every stripe-free layout
    req = RingRequest(None, layout=layout, backend="math")
    resolved, masks = [], []
    real_resolve, real_mask = request_mod.resolve_kernel, request_mod.make_mask
    request_mod.resolve_kernel = lambda *a, **kw: resolved.append(a) or real_resolve(*a, **kw)
    request_mod.make_mask = lambda *a, **kw: masks.append(a) or real_mask(*a, **kw)
    try:
        for i in range(3):
            full = _inputs(seq, SEED + i) + [_inputs(seq, SEED + 10 + i)[0]]
            for name, err in _run(req, full, layout).items():
                assert err < 1e-10, (layout, i, name, err)
        assert len(resolved) == 1, resolved
        cu = [0, 12, 40, 60] if layout == "zigzag" else [0, 7, 33, 60]
        docs = req.derive(cu_seqlens=torch.tensor(cu, dtype=torch.int32))
        assert req.derive(cu_seqlens=cu) is docs, "a batch's documents were not kept for its next layer"
        for i in range(2):
            full = _inputs(seq, SEED + 20 + i) + [_inputs(seq, SEED + 30 + i)[0]]
            for name, err in _run(docs, full, layout, cu).items():
                assert err < 1e-10, (layout, "documents", i, name, err)
        assert len(masks) == 1, f"the documents were checked {len(masks)} times for two calls"
        windowed = req.derive(window_size=(9, 0))
        assert windowed.window == (9, 0) and req.window is None
        full = _inputs(seq, SEED + 40) + [_inputs(seq, SEED + 41)[0]]
        for name, err in _run(windowed, full, layout).items():
            assert err < 1e-10, (layout, "window", name, err)
    finally:
        request_mod.resolve_kernel, request_mod.make_mask = real_resolve, real_mask


def _mla_inputs(seq, seed, dv, h=4, kvh=2, d=8):
    """q, k of head dim ``d``, v and dout of ``dv`` (multi-latent attention's shapes), float64."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(1, seq, heads, dim, generator=gen, dtype=torch.float64) * 0.7
            for heads, dim in ((h, d), (kvh, d), (kvh, dv), (h, dv))]


def check_value_head_dim(layout, backend, dv):
    """v's head dim differs from q/k's (8): smaller or larger, on a kernel that takes it as it is
    (math) and on one that needs v padded to q/k's or q/k to v's (torch); the scale stays q's
    ``8 ** -0.5``.  One request: plain, then with documents and a window, then q/k's own head dim
    in between (another call shape of the same request): exact against float64 each time."""
    seq = 2 * 3 * 10
    req = RingRequest(None, layout=layout, backend=backend)
    cu = [0, 12, 40, 60] if layout == "zigzag" else [0, 7, 33, 60]
    masked = req.derive(cu_seqlens=cu, window_size=(9, 0))
    resolved, real_resolve = [], request_mod.resolve_kernel
    request_mod.resolve_kernel = lambda *a, **kw: resolved.append(a[3]) or real_resolve(*a, **kw)
    try:
        for i, (request, bounds, width) in enumerate([(req, None, dv), (masked, cu, dv), (req, None, 8),
                                                      (req, None, dv)]):
            full = _mla_inputs(seq, SEED + 50 + i, width)
            errs = _run(request, full, layout, bounds)
            assert all(err < 1e-10 for err in errs.values()), (layout, backend, dv, i, errs)
    finally:
        request_mod.resolve_kernel = real_resolve
    # the kernel is resolved for the (q/k, v) head dims (a kernel judges its own MLA shapes; the ones
    # without pad to the larger), once per v shape and request
    assert resolved == [(8, dv), (8, dv), 8], resolved


def check_per_call_agreement_meets_every_time():
    """``agreeing(cached=False)``: a rank whose checks pass still meets a rank whose checks failed,
    call after call (the cached exchange would let it skip the second time)."""
    rank = dist.get_rank()
    for _ in range(2):
        match = "bad on rank 1" if rank == 1 else r"rank 1 of the group refused: ValueError: bad on rank 1"
        with pytest.raises(ValueError, match=match):
            with agreement.agreeing(None, what="test", enabled=True, cached=False):
                if rank == 1:
                    raise ValueError("bad on rank 1")
    with agreement.agreeing(None, what="test", enabled=True, cached=False):
        pass  # every rank passes: nothing raised
    assert agreement.gather_rows(None, [rank, 7], what="test") == [[0, 7], [1, 7]]


CASES = [(f"once_{layout}", check_built_once_called_many, (layout,)) for layout in ("striped", "zigzag", "contiguous")]
CASES += [(f"v_head_dim_{dv}_{layout}_{backend}", check_value_head_dim, (layout, backend, dv))
          for layout, backend, dv in (("striped", "math", 12), ("zigzag", "math", 6), ("striped", "torch", 6),
                                      ("contiguous", "torch", 12))]
CASES.append(("per_call_agreement", check_per_call_agreement_meets_every_time, ()))


@pytest.fixture(scope="module")
def results():
    return run_cases(WORLD, CASES)


@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_request_on_two_ranks(results, name):
    check_case(results, name)


# -- single process: what building checks, with no process group -------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"layout": "ring"}, "unknown layout 'ring'"),
    ({"backend": "cuda"}, "unknown backend 'cuda'"),
    ({"softmax_scale": 0.0}, "softmax_scale=0.0 must be positive"),
    ({"ulysses_size": 0}, "ulysses_size=0 must be a positive int"),
    ({"window_size": (3, 2)}, "right must be 0 when causal=True"),
    ({"window_size": (3, 0), "sliding_window": 4}, "not both"),
    ({"sliding_window": 0}, "sliding_window=0 must be a positive int"),
    ({"cu_seqlens": torch.zeros(2, 2, dtype=torch.int64)}, "must be 1-D"),
    ({"timeout": -1}, "timeout"),
])
def test_building_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RingRequest(None, **kwargs)


def test_window_conventions_are_one():
    assert window_of(None, 5) == (4, 0) == window_of((4, 0))
    assert window_of((3, -1), causal=False) == (3, -1) and window_of() is None
    from striped_sp.deepspeed.hf import hf_window

    assert hf_window(5) == (4, 0)


def test_hf_boundaries_read_once_per_batch(monkeypatch):
    """The same cu_seq_lens tensors (every layer of one batch) are compared and read once; a new
    batch, or the same tensor changed in place, is read again."""
    from striped_sp.deepspeed import hf, packed

    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    kwargs = {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}
    assert hf._boundaries(kwargs) == (0, 5, 12)
    cu[1] = 6  # in place: its version changes
    assert hf._boundaries(kwargs) == (0, 6, 12)
    reads = []
    real = packed.as_bounds
    monkeypatch.setattr(packed, "as_bounds", lambda x: reads.append(1) or real(x))
    for _ in range(4):
        assert hf._boundaries(kwargs) == (0, 6, 12)
    assert reads == [], "the batch's boundaries were read again for another layer"
    other = {"cu_seq_lens_q": cu.clone(), "cu_seq_lens_k": cu.clone()}
    assert hf._boundaries(other) == (0, 6, 12) and reads == [1]
    with pytest.raises(ValueError, match="differ"):
        hf._boundaries({"cu_seq_lens_q": cu, "cu_seq_lens_k": torch.tensor([0, 4, 12])})


def test_distributed_attention_reads_a_batch_once_for_all_layers(monkeypatch):
    """DeepSpeed's DistributedAttention, one module per layer: the batch's cu_seqlens tensor is read
    on the host, and its rotary positions built and moved to the device, once per batch (on CUDA each
    read is a synchronisation and each move a blocking copy), not once per layer; the rotary rows
    are the layout's positions of this rank."""
    from striped_sp.deepspeed import distributed_attention as da
    from striped_sp.deepspeed import packed
    from striped_sp.engine.request import RingRequest

    n, rank, local = 2, 1, 6
    monkeypatch.setattr(da.dist, "get_world_size", lambda group=None: n)
    monkeypatch.setattr(da.dist, "get_rank", lambda group=None: rank)
    calls = []  # each layer's (request bounds, rotated query) instead of the ring
    monkeypatch.setattr(RingRequest, "__call__", lambda self, q, k, v: calls.append((self.bounds, q)) or q)
    reads, built = [], []
    real_bounds, real_positions = packed.as_bounds, packed.positions
    monkeypatch.setattr(packed, "as_bounds", lambda x: reads.append(1) or real_bounds(x))
    monkeypatch.setattr(packed, "positions", lambda *a: built.append(1) or real_positions(*a))
    packed.device_positions.cache_clear()
    layers = [da.DistributedAttention(None, None, layout="zigzag") for _ in range(3)]
    gen = torch.Generator().manual_seed(SEED)
    q, k, v = (torch.randn(1, local, 2, 4, generator=gen) for _ in range(3))
    angles = torch.arange(n * local, dtype=torch.float32).view(-1, 1, 1, 1).expand(-1, 1, 1, 4)
    rotary = (angles.cos(), angles.sin())  # [S, 1, 1, d]: position p's table is cos(p), sin(p)
    for batch, cut in enumerate((4, 8)):  # zigzag: documents of multiples of 2N
        cu = torch.tensor([0, cut, n * local], dtype=torch.int32)  # a new batch: a new tensor
        for layer in layers:
            layer(q, k, v, 0, rotary, cu_seqlens=cu)
        assert reads == [1] * (batch + 1), f"cu_seqlens read {len(reads)} times in {batch + 1} batches of 3 layers"
        assert built == [1] * (batch + 1), f"rotary positions built {len(built)} times in {batch + 1} batches"
    assert len(calls) == 6
    for i, (bounds, got) in enumerate(calls):
        cut = (4, 8)[i // 3]
        assert bounds == (0, cut, n * local)
        pos = striped_sp.positions(n * local, n, rank, "zigzag", [0, cut, n * local]).float().view(1, -1, 1, 1)
        half = torch.cat([-q[..., 2:], q[..., :2]], -1)
        torch.testing.assert_close(got, q * pos.cos() + half * pos.sin())  # rotate-half on this rank's positions


# -- layout facts the adapters ask, and the one algo table ---------------------------------------

@pytest.mark.parametrize("layout", ["striped", "zigzag", "contiguous", "striped:stripe=3", "striped:place=2"])
@pytest.mark.parametrize("rows, local_len", [(2, 6), (3, 4), (2, 9)])
def test_flattens_rows_matches_brute_force(layout, rows, local_len):
    """``flattens_rows`` iff the shard of the rows (each with two documents) laid end to end is, row
    by row, the shard of each row (positions compared directly)."""
    n = 2
    lay = get_layout(layout)
    seq = local_len * n
    want = True
    for row_docs in ([0, 5, seq], [0, 1, 3, seq]):
        flat_docs = [0] + [i * seq + b for i in range(rows) for b in row_docs[1:]]
        try:
            per_row = [torch.cat([i * seq + positions(seq, n, r, lay, row_docs) for i in range(rows)])
                       for r in range(n)]
            flat = [positions(rows * seq, n, r, lay, flat_docs) for r in range(n)]
            want &= all(torch.equal(a, b) for a, b in zip(per_row, flat))
        except ValueError:  # documents or a row length the layout does not take
            want = False
    assert lay.flattens_rows(local_len) == want, (layout, rows, local_len)


def test_flattens_rows_of_grouped_layout_is_false():
    from striped_sp.plan.grouped import GroupedLayout

    assert not GroupedLayout(LAYOUTS["striped"], 2).flattens_rows(8)


def test_one_algo_table():
    from striped_sp.deepspeed.config import ALGOS as DS_ALGOS
    from striped_sp.deepspeed.distributed_attention import DistributedAttention
    from striped_sp.megatron.arguments import ALGOS as MEGATRON_ALGOS

    assert ALGOS["ring"] == "contiguous" and DS_ALGOS is ALGOS
    assert MEGATRON_ALGOS == {"native": None, **ALGOS}
    assert DistributedAttention(None, None, layout="ring").layout == "contiguous"
    for name in ("megatron/arguments.py", "deepspeed/config.py", "deepspeed/distributed_attention.py"):
        assert '"ring": "contiguous"' not in (ROOT / "striped_sp" / name).read_text(), name


# -- the kernels package --------------------------------------------------------------------------

def test_kernel_names_still_importable():
    from striped_sp.kernels import (BACKENDS, KERNELS, FlashAttnKernel, Kernel, MathKernel, TorchKernel,  # noqa: F401
                                    _DETERMINISTIC_FLASH_ATTN, _deterministic_reason, accumulator_dtype,
                                    available_backends, gqa_probe_enabled, resolve_kernel)

    assert list(KERNELS) == ["torch", "torch_cudnn", "flash_attn", "fa4", "math"]
    assert BACKENDS == ("auto", *KERNELS)


def test_core_reads_a_cu_seqlens_tensor_once_per_batch(monkeypatch):
    """ring_attention / RingRequest given the batch's cu_seqlens tensor in every layer: it is read on
    the host (a synchronisation on CUDA) once; a tensor changed in place or a new batch's is read
    again, and the bounds are its values."""
    reads = []
    real = request_mod.as_bounds
    monkeypatch.setattr(request_mod, "as_bounds", lambda x: reads.append(1) or real(x))
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    base = RingRequest(None)
    for _ in range(4):  # the layers of one batch: functional calls build a request, modules derive one
        assert RingRequest(None, cu_seqlens=cu).bounds == (0, 5, 12)
        assert base.derive(cu_seqlens=cu).bounds == (0, 5, 12)
    assert reads == [1], f"read {len(reads)} times for one batch"
    cu[1] = 6
    assert base.derive(cu_seqlens=cu).bounds == (0, 6, 12) and reads == [1, 1]
    assert RingRequest(None, cu_seqlens=torch.tensor([0, 7, 12])).bounds == (0, 7, 12) and len(reads) == 3


def test_checked_calls_per_request_are_bounded(monkeypatch):
    """Batches of ever new lengths (variable-length rows) keep a bounded number of checked calls per
    request: the least recently used go first (a shape used again stays)."""
    monkeypatch.setattr(request_mod.dist, "get_world_size", lambda group=None: 2)
    req = RingRequest(None, backend="math")

    def call(s):
        q = torch.zeros(1, s, 2, 4)
        req._prepare(q, q, q, None)

    n = request_mod._CALLS
    for s in range(1, n + 1):
        call(s)
    call(1)  # a hit: now the most recently used
    for s in range(n + 1, n + 4):
        call(s)
    kept = sorted(key[0][1] for key in req._calls)
    assert kept == [1, *range(5, n + 4)], kept  # 2, 3, 4 went first, not the shape used again


def test_cu_seqlens_made_in_inference_mode_or_as_a_list():
    """Tensors made under torch.inference_mode() have no version counter, lists none either: both are
    read as they are each time (a list changed in place gives its new bounds)."""
    from striped_sp.deepspeed.packed import batch_bounds as ds_bounds

    with torch.inference_mode():
        cu = torch.tensor([0, 5, 12])
    assert RingRequest(None, cu_seqlens=cu).bounds == (0, 5, 12) == RingRequest(None).derive(cu_seqlens=cu).bounds
    assert ds_bounds(cu) == (0, 5, 12) == ds_bounds(cu, cu)
    listed = [0, 4, 12]
    assert ds_bounds(listed) == (0, 4, 12) == request_mod.batch_bounds(listed)
    listed[1] = 8
    assert ds_bounds(listed) == (0, 8, 12) == request_mod.batch_bounds(listed)
