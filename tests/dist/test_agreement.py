"""Cross-rank agreement (striped_sp/agreement.py): ranks called with different arguments all raise a
ValueError naming the field and both values, once per new signature; agreed signatures send nothing."""

import datetime
import os
import time

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import check_case, run_cases
from reference import reference_attention, rel_err
from seeds import seed_for
from striped_sp.engine import agreement

SEED = seed_for(__name__)  # the same in every spawned rank


def _qkv(s=4, h=4, kvh=2, d=8, dtype=torch.float32, seed=SEED):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(1, s, heads, d, generator=gen).to(dtype) for heads in (h, kvh, kvh))


class _Counter:
    """Counts the agreement's exchanges (calls of its all-gather) while active."""

    def __init__(self):
        self.calls = 0
        self._real = agreement._all_gather

    def __enter__(self):
        def counting(*args, **kwargs):
            self.calls += 1
            return self._real(*args, **kwargs)

        agreement._all_gather = counting
        return self

    def __exit__(self, *exc):
        agreement._all_gather = self._real


# field -> (this rank's keyword arguments, the expected message); rank 1 differs from rank 0
def _disagreement(field, rank):
    if field == "layout":
        return {"layout": ["striped", "zigzag"][rank]}, r"rank 1 passed layout='zigzag', rank 0 passed 'striped'"
    if field == "causal":
        return {"causal": [True, False][rank]}, "rank 1 passed causal=False, rank 0 passed True"
    if field == "softmax_scale":
        return {"softmax_scale": [0.25, 0.5][rank]}, "rank 1 passed softmax_scale=0.5, rank 0 passed 0.25"
    if field == "ulysses_size":
        return {"ulysses_size": [1, 2][rank]}, "rank 1 passed ulysses_size=2, rank 0 passed 1"
    if field == "backend":
        return {"backend": ["torch", "math"][rank]}, "rank 1 passed backend='math', rank 0 passed 'torch'"
    if field == "grad_comm_dtype":
        return ({"grad_comm_dtype": [torch.float32, torch.bfloat16][rank]},
                "rank 1 passed grad_comm_dtype=torch.bfloat16, rank 0 passed torch.float32")
    if field == "deterministic":
        return {"deterministic": [False, True][rank]}, "rank 1 passed deterministic=True, rank 0 passed False"
    if field == "cu_seqlens":  # the batch's documents: the ranks would build different plans
        return ({"cu_seqlens": torch.tensor([[0, 20, 64], [0, 10, 64]][rank], dtype=torch.int32)},
                r"rank 1 passed cu_seqlens=\(0, 10, 64\), rank 0 passed \(0, 20, 64\)")
    if field == "window_size":
        return {"window_size": [(31, 0), (63, 0)][rank]}, r"rank 1 passed window_size=\(63, 0\), rank 0 passed \(31, 0\)"
    raise AssertionError(field)


FIELDS = ["layout", "causal", "softmax_scale", "ulysses_size", "backend", "grad_comm_dtype", "deterministic",
          "cu_seqlens", "window_size"]
FAST_S = 10.0  # a disagreement is one exchange; a rank left waiting would take the ring timeout (30 s here)
STUCK_TIMEOUT_S = 2.0
GROUP_TIMEOUT_S = 45.0  # a group timeout (Megatron: 30 minutes) the exchange must not wait for


def check_field_disagreement(field):
    """Each field alone: every rank raises (the same text), naming the field and both values, at
    once (32 tokens per rank: a global row of 64)."""
    rank = dist.get_rank()
    kwargs, match = _disagreement(field, rank)
    q, k, v = _qkv(s=32)
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        striped_sp.ring_attention(q, k, v, **kwargs)
    assert time.monotonic() - start < FAST_S, f"{field}: raised after {time.monotonic() - start:.1f} s"


def check_shapes_and_dtype():
    rank = dist.get_rank()
    q, k, v = _qkv(s=8, kvh=[2, 1][rank])
    with pytest.raises(ValueError, match=r"rank 1 passed k.shape=\(1, 8, 1, 8\), rank 0 passed \(1, 8, 2, 8\)"):
        striped_sp.ring_attention(q, k, v)
    q, k, v = _qkv(s=8, dtype=[torch.float32, torch.bfloat16][rank])
    with pytest.raises(ValueError, match="rank 1 passed dtype=torch.bfloat16, rank 0 passed torch.float32"):
        striped_sp.ring_attention(q, k, v)


def check_many_fields_named():
    """Several fields differ: each is named (and nothing that agrees)."""
    rank = dist.get_rank()
    q, k, v = _qkv(s=8)
    with pytest.raises(ValueError) as info:
        striped_sp.ring_attention(q, k, v, causal=rank == 0, softmax_scale=0.3 + rank * 0.1)
    text = str(info.value)
    assert "causal=False" in text and "softmax_scale=0.4" in text, text
    assert "layout=" not in text and "q.shape=" not in text, text


def check_cached_after_agreement():
    """A new signature costs one exchange, a known one none; the cache is an LRU of CACHE_SIZE."""
    agreement.clear_cache()
    q, k, v = _qkv(s=6)
    with _Counter() as c:
        striped_sp.ring_attention(q, k, v)
        assert c.calls == 1
        for _ in range(3):
            striped_sp.ring_attention(q, k, v)
        assert c.calls == 1, "an agreed signature was exchanged again"
        striped_sp.ring_attention(q, k, v, window_size=(3, 0))
        assert c.calls == 2, "a new window was not checked"
    old = agreement.CACHE_SIZE
    agreement.CACHE_SIZE = 2
    try:
        with _Counter() as c:
            for scale in (0.1, 0.2, 0.3):  # the first is evicted by the third
                striped_sp.ring_attention(q, k, v, softmax_scale=scale)
            striped_sp.ring_attention(q, k, v, softmax_scale=0.3)
            assert c.calls == 3
            striped_sp.ring_attention(q, k, v, softmax_scale=0.1)
            assert c.calls == 4, "an evicted signature was not checked again"
    finally:
        agreement.CACHE_SIZE = old


def check_switch():
    """$STRIPED_SP_CHECK_RANKS: '0' sends nothing (disagreeing windows go unnoticed); values other
    than 0/1 are refused by name on every rank before any message."""
    rank = dist.get_rank()
    agreement.clear_cache()
    q, k, v = _qkv(s=6)
    os.environ["STRIPED_SP_CHECK_RANKS"] = "false"
    try:
        with pytest.raises(ValueError, match=r"\$STRIPED_SP_CHECK_RANKS='false' must be '1'"):
            striped_sp.ring_attention(q, k, v)
        os.environ["STRIPED_SP_CHECK_RANKS"] = "0"
        with _Counter() as c:
            out = striped_sp.ring_attention(q, k, v, window_size=(2 + rank, 0))
        assert c.calls == 0 and torch.isfinite(out).all()
    finally:
        del os.environ["STRIPED_SP_CHECK_RANKS"]


def check_always():
    """$STRIPED_SP_CHECK_RANKS=always: every call is checked, so a rank calling with a signature the
    group agreed on before while another calls with a new one is a ValueError, not a timeout."""
    rank = dist.get_rank()
    agreement.clear_cache()
    q, k, v = _qkv(s=6)
    os.environ["STRIPED_SP_CHECK_RANKS"] = "always"
    try:
        with _Counter() as c:
            striped_sp.ring_attention(q, k, v)
            striped_sp.ring_attention(q, k, v)
        assert c.calls == 2
        with pytest.raises(ValueError, match=r"rank 1 passed window_size=\(2, 0\), rank 0 passed None"):
            striped_sp.ring_attention(q, k, v, window_size=(2, 0) if rank == 1 else None)
    finally:
        del os.environ["STRIPED_SP_CHECK_RANKS"]


def check_per_call_exchange_waits_the_ring_timeout():
    """The adapters' per-call exchange (``agreeing(cached=False)``, no ``timeout=``) waits for a
    stuck peer the ring timeout (module docstring), not the group's own (gloo: 30 minutes for a
    ``new_group``): rank 0 raises a TimeoutError naming the check.  A group of its own: a pair that
    timed out is closed for good."""
    from striped_sp.engine.transport import set_ring_timeout

    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    dist.barrier()
    if dist.get_rank() == 1:
        time.sleep(STUCK_TIMEOUT_S + 3)  # never joins
        return
    set_ring_timeout(STUCK_TIMEOUT_S)
    start = time.monotonic()
    try:
        with pytest.raises(TimeoutError, match="rank 0 of the group waited more than 2 s"):
            with agreement.agreeing(group, what="test", enabled=True, cached=False):
                pass
    finally:
        set_ring_timeout(None)
    assert time.monotonic() - start < STUCK_TIMEOUT_S + FAST_S


def check_still_exact():
    """After the disagreements above, an agreeing call runs exact (no message left half-sent)."""
    from striped_sp import shard

    n, rank = dist.get_world_size(), dist.get_rank()
    q, k, v = _qkv(s=12 * n, seed=SEED + 1)
    local = [shard(t, n, rank).requires_grad_() for t in (q, k, v)]
    out = striped_sp.ring_attention(*local, window_size=(5, 0), softmax_scale=0.3)
    ref = reference_attention(q, k, v, True, 0.3, window_size=(5, 0))
    assert rel_err(out, shard(ref, n, rank)) < 1e-5


CASES = ([(f"differ-{f}", check_field_disagreement, (f,)) for f in FIELDS] + [
    ("differ-shapes-dtype", check_shapes_and_dtype, ()),
    ("differ-many", check_many_fields_named, ()),
    ("cache", check_cached_after_agreement, ()),
    ("switch", check_switch, ()),
    ("always", check_always, ()),
    ("per-call-timeout", check_per_call_exchange_waits_the_ring_timeout, ()),
    ("still-exact", check_still_exact, ()),
])
_results = {}


@pytest.mark.parametrize("name", [name for name, _, _ in CASES])
def test_agreement_two_ranks(name):
    if "all" not in _results:
        _results["all"] = run_cases(2, CASES)
    check_case(_results["all"], name)


def test_digest_is_stable_across_processes():
    """The digest must not depend on the process (Python's hash() of a str does)."""
    assert agreement._digest("layout='striped'") == agreement._digest("layout='striped'")
    assert agreement._digest("a") != agreement._digest("b")
    import subprocess
    import sys

    code = "from striped_sp.engine import agreement; print(agreement._digest(\"('q.shape', (1, 4))\"))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "PYTHONHASHSEED": "random"}).stdout.strip()
    assert int(other) == agreement._digest("('q.shape', (1, 4))")


def test_switch_values_without_a_group():
    os.environ.pop("STRIPED_SP_CHECK_RANKS", None)
    assert agreement.check_ranks_enabled()
    for value, on in (("1", True), ("0", False), ("always", True)):
        os.environ["STRIPED_SP_CHECK_RANKS"] = value
        try:
            assert agreement.check_ranks_enabled() is on
        finally:
            del os.environ["STRIPED_SP_CHECK_RANKS"]
    for bad in ("", "false", "true", "2", " 1"):
        os.environ["STRIPED_SP_CHECK_RANKS"] = bad
        try:
            with pytest.raises(ValueError, match="STRIPED_SP_CHECK_RANKS"):
                agreement.check_ranks_enabled()
        finally:
            del os.environ["STRIPED_SP_CHECK_RANKS"]


def test_cpu_calls_never_ask_cuda_about_graph_capture(monkeypatch):
    """A CPU run whose torch reports CUDA (a CUDA build, or Megatron's CPU shims) must not
    initialise CUDA: the capture check is for CUDA tensors only."""
    import torch

    from striped_sp.engine import agreement

    def boom():
        raise RuntimeError("CUDA driver version is insufficient for CUDA runtime version")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", boom)
    assert agreement._tracing(torch.device("cpu")) is False
    with pytest.raises(RuntimeError, match="insufficient"):
        agreement._tracing(torch.device("cuda"))


def test_data_loader_check_switch_refuses_bad_values(monkeypatch):
    from striped_sp.deepspeed.data import ShardedDataLoader

    for value in ("", "0", "1", "always"):
        monkeypatch.setenv("STRIPED_SP_CHECK_RANKS", value)
        assert ShardedDataLoader([], None).check_ranks is False  # one rank: nothing to compare
    monkeypatch.setenv("STRIPED_SP_CHECK_RANKS", "false")
    with pytest.raises(ValueError, match="STRIPED_SP_CHECK_RANKS='false'"):
        ShardedDataLoader([], None)
