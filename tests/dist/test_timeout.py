"""The ring timeout: a stuck peer makes the waiting rank raise TimeoutError naming itself, the peer
and the ring step, within the timeout, instead of holding it for gloo's 30 minutes (a peer whose
process died: tests/dist/test_dead_peer.py).

Each scenario runs on its own gloo group (a timed-out gloo pair is closed for good); the default
group only synchronises the scenarios.  The stuck rank leaves the scenario early and waits in the
default group's barrier after it, which the other rank reaches only once its own call has raised:
from the scenario group's side a peer that never comes, for as long as the other rank waits, with
no fixed sleep to sit out.  run_cases bounds the whole run, so a regression fails the test instead
of hanging the suite.

Every timeout must be the ring's own (``timeout=2``), not the process group's: each error names the
ring timeout ("more than 2 s") and comes within a few seconds of it.  The scenario groups get a
timeout of their own, :data:`GROUP_TIMEOUT_S`, past the ring's and its lateness allowance but far
under the harness's 60 s, so a ring timeout that is not applied (say, tested on the wrong device
type) shows in seconds, by its message ("past the process group's timeout") and its time."""

import datetime
import time

import pytest
import torch
import torch.distributed as dist

import striped_sp
from dist_helper import check_case, run_cases
from seeds import seed_for
from striped_sp.engine import transport as ring

SEED = seed_for(__name__)
TIMEOUT_S = 2.0
#: the most a ring timeout may take beyond TIMEOUT_S to raise (under GROUP_TIMEOUT_S - TIMEOUT_S)
LATE_S = 3.0
#: each scenario group's own gloo timeout: what a wait without the ring timeout would get
GROUP_TIMEOUT_S = TIMEOUT_S + LATE_S + 4.0


def _qkv(s=8):
    gen = torch.Generator().manual_seed(SEED)
    return tuple(torch.randn(1, s, 2, 8, generator=gen).requires_grad_() for _ in range(3))


def _timed(fn):
    """(exception or None, seconds) of ``fn()``."""
    start = time.monotonic()
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the scenario inspects it
        return err, time.monotonic() - start
    return None, time.monotonic() - start


def _expect(err, seconds, kind, *parts):
    assert isinstance(err, kind), f"expected {kind.__name__}, got {err!r}"
    if kind is TimeoutError:  # the ring's own timeout, not the group's
        assert f"more than {TIMEOUT_S:g} s" in str(err), f"not the ring timeout of {TIMEOUT_S:g} s: {err}"
        assert seconds >= TIMEOUT_S - 0.1, f"raised after {seconds:.1f} s, before the timeout of {TIMEOUT_S} s"
    assert seconds < TIMEOUT_S + LATE_S, f"raised after {seconds:.1f} s, the timeout is {TIMEOUT_S} s"
    for part in parts:
        assert part in str(err), f"{part!r} not in: {err}"


def stuck_in_forward(group):
    """Both ranks agree once; then rank 1 stalls and rank 0's next call waits in the ring."""
    q, k, v = _qkv()
    striped_sp.ring_attention(q, k, v, group, timeout=TIMEOUT_S)  # agreed: the next call sends no check
    if dist.get_rank() == 1:
        return  # stuck: waits in run_scenario's barrier until rank 0 is done
    err, seconds = _timed(lambda: striped_sp.ring_attention(q, k, v, group, timeout=TIMEOUT_S))
    _expect(err, seconds, TimeoutError, "rank 0 (rank 0 of its CP group of 2)", "rank 1", "forward step 1 of 2",
            f"{TIMEOUT_S:g} s")


def stuck_in_backward(group):
    """Rank 1 runs the forward, then stalls before its backward."""
    q, k, v = _qkv()
    out = striped_sp.ring_attention(q, k, v, group, timeout=TIMEOUT_S)
    if dist.get_rank() == 1:
        return  # stuck: waits in run_scenario's barrier until rank 0 is done
    err, seconds = _timed(lambda: out.sum().backward())
    _expect(err, seconds, TimeoutError, "rank 0", "rank 1", "backward step 1 of 2")


def stuck_before_agreement(group):
    """Rank 1 never calls: rank 0's first call waits in the agreement exchange, then raises.  The
    group agreed on nothing before, so no peer can have skipped the check: the message names only a
    stuck or gone peer, not ranks called with different arguments."""
    if dist.get_rank() == 1:
        return  # stuck: waits in run_scenario's barrier until rank 0 is done
    q, k, v = _qkv(s=6)
    err, seconds = _timed(lambda: striped_sp.ring_attention(q, k, v, group, timeout=TIMEOUT_S))
    _expect(err, seconds, TimeoutError, "ring_attention: rank 0 of the group waited more than 2 s",
            "check their arguments", "a peer is stuck or gone", "has not reached this call")
    assert "different arguments" not in str(err) and "skipped" not in str(err), str(err)


def stuck_before_later_agreement(group):
    """Both ranks agree once; then rank 1 stalls while rank 0 calls with a new signature: the
    timeout's message names both causes (a stuck peer, or one that skipped the check)."""
    q, k, v = _qkv()
    striped_sp.ring_attention(q, k, v, group, timeout=TIMEOUT_S)
    if dist.get_rank() == 1:
        return  # stuck: waits in run_scenario's barrier until rank 0 is done
    q, k, v = _qkv(s=6)
    err, seconds = _timed(lambda: striped_sp.ring_attention(q, k, v, group, timeout=TIMEOUT_S))
    _expect(err, seconds, TimeoutError, "rank 0 of the group waited more than 2 s", "a peer is stuck or gone",
            "skipped the check", "different arguments")


def stuck_before_batch_check(group):
    """The data loader's same-batch check meets on every call (no cache, nothing to skip): a stuck
    peer's timeout names only a stuck or gone peer, even after earlier checks passed."""
    from striped_sp.engine.agreement import gather_rows

    timeout = datetime.timedelta(seconds=TIMEOUT_S)
    gather_rows(group, [1, 2], what="check_same_batch", timeout=timeout)
    if dist.get_rank() == 1:
        return  # stuck: waits in run_scenario's barrier until rank 0 is done
    err, seconds = _timed(lambda: gather_rows(group, [1, 2], what="check_same_batch", timeout=timeout))
    _expect(err, seconds, TimeoutError, "check_same_batch: rank 0 of the group waited more than 2 s",
            "a peer is stuck or gone")
    assert "different arguments" not in str(err) and "skipped" not in str(err), str(err)


def error_while_peer_skips_check(group):
    """Rank 1 calls with an agreed signature (no exchange) while rank 0's own check fails: rank 0
    raises its own ValueError after the timeout, rank 1 a TimeoutError in the ring."""
    q, k, v = _qkv()
    striped_sp.ring_attention(q, k, v, group, timeout=TIMEOUT_S)
    if dist.get_rank() == 1:
        err, seconds = _timed(lambda: striped_sp.ring_attention(q, k, v, group, timeout=TIMEOUT_S))
        _expect(err, seconds, TimeoutError, "rank 1", "forward step 1 of 2")
        return
    err, seconds = _timed(lambda: striped_sp.ring_attention(q, k, v, group, timeout=TIMEOUT_S, softmax_scale=-1.0))
    _expect(err, seconds, ValueError, "softmax_scale=-1.0 must be positive")


SCENARIOS = [stuck_in_forward, stuck_in_backward, stuck_before_agreement, stuck_before_batch_check,
             stuck_before_later_agreement, error_while_peer_skips_check]


def run_scenario(name):
    """``name`` on a fresh group of both ranks (gloo's default group only synchronises)."""
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    dist.barrier()
    try:
        {s.__name__: s for s in SCENARIOS}[name](group)
    finally:
        dist.barrier()  # the stuck rank waits here, on the default group, until the other one raised


CASES = [(s.__name__, run_scenario, (s.__name__,)) for s in SCENARIOS]
_results = {}


@pytest.mark.parametrize("scenario", [s.__name__ for s in SCENARIOS])
def test_stuck_peer(scenario):
    if "all" not in _results:
        _results["all"] = run_cases(2, CASES, timeout_s=300)
    check_case(_results["all"], scenario)


def test_ring_timeout_settings(monkeypatch):
    monkeypatch.delenv(ring.TIMEOUT_ENV, raising=False)
    assert ring.ring_timeout() == datetime.timedelta(seconds=ring.DEFAULT_TIMEOUT_S)
    assert ring.DEFAULT_TIMEOUT_S < 30 * 60
    monkeypatch.setenv(ring.TIMEOUT_ENV, "42.5")
    assert ring.ring_timeout().total_seconds() == 42.5
    ring.set_ring_timeout(7)
    try:
        assert ring.ring_timeout().total_seconds() == 7  # the adapters' setting beats the environment
        assert ring.ring_timeout(3).total_seconds() == 3  # and the call's argument beats both
        assert ring.ring_timeout(datetime.timedelta(minutes=1)).total_seconds() == 60
    finally:
        ring.set_ring_timeout(None)
    for bad in ("0", "-1", "inf", "nan", "ten"):
        monkeypatch.setenv(ring.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=r"\$STRIPED_SP_RING_TIMEOUT_S=.* must be a positive, finite"):
            ring.ring_timeout()
    monkeypatch.delenv(ring.TIMEOUT_ENV)
    for bad in (0, -2.0, True, "x"):
        with pytest.raises(ValueError, match="timeout=.* must be a positive, finite"):
            ring.ring_timeout(bad)
    with pytest.raises(ValueError, match="ring timeout=-1 must be"):
        ring.set_ring_timeout(-1)


def test_megatron_flag_sets_the_ring_timeout():
    import argparse

    from striped_sp.megatron.arguments import add_arguments, validate_args

    parser = add_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--context-parallel-algo", "striped", "--context-parallel-timeout-s", "90"])
    args.context_parallel_size, args.seq_length = 2, 64
    try:
        validate_args(args)
        assert ring.ring_timeout().total_seconds() == 90
        args.context_parallel_timeout_s = -5.0
        with pytest.raises(ValueError, match="--context-parallel-timeout-s -5.0 must be a positive"):
            validate_args(args)
    finally:
        ring.set_ring_timeout(None)
    assert parser.parse_args([]).context_parallel_timeout_s is None


def test_deepspeed_key_is_parsed():
    pytest.importorskip("deepspeed")
    from striped_sp.deepspeed.config import parse_config

    assert parse_config({"context_parallel": {"timeout_s": 45}}).timeout_s == 45.0
    assert parse_config({}).timeout_s is None
    for bad in (0, -1, "soon", float("inf")):
        with pytest.raises(ValueError, match="context_parallel.timeout_s="):
            parse_config({"context_parallel": {"timeout_s": bad}})
