"""Transports: how a rank's blocks reach the next rank of the ring.

A :class:`Transport` posts a shift (send to the rank ``hops`` ahead, receive from the one as far
behind) and returns a transfer whose ``wait()`` gives the received tensors.  Two of them:

* :class:`TorchTransport`: the ring over a process group (``batch_isend_irecv``), neighbours from
  the group itself, with the ring timeout below;
* :class:`LocalTransport`: all ``N`` ranks in one process (:class:`LocalRing`): the executor's
  generators run side by side (:func:`run_local`), a transfer is a hand-over in memory.  It is the
  simulator (``striped-sp bench sim``), the large-N tests and the dry run of the CUDA path on meta
  tensors.

The executor (:mod:`striped_sp.engine.autograd`) is written as generators that *yield* each
transfer they wait for: :func:`drive` runs one to the end on a blocking transport.

The ring timeout:

A peer that stops (stuck, or killed without closing its sockets) would otherwise hold every rank
for the process group's timeout (gloo: 30 minutes).  Each transfer is waited on with the ring
timeout instead; past it the rank raises ``TimeoutError`` naming itself, the peer and the ring step.
The timeout is, in order: ``ring_attention(..., timeout=)``; :func:`set_ring_timeout` (the Megatron
flag ``--context-parallel-timeout-s`` and the DeepSpeed key ``context_parallel.timeout_s`` set it);
``$STRIPED_SP_RING_TIMEOUT_S``; :data:`DEFAULT_TIMEOUT_S`.  It applies to CPU tensors (gloo), whose
``Work.wait(timeout=)`` raises after it (torch 2.13, checked); on CUDA (NCCL) the wait stays
asynchronous and the process group's own timeout (NCCL's watchdog, 10 minutes by default) applies.
A peer whose process exited (gloo: "Connection closed by peer", at the post or during the wait)
makes the rank raise ``RuntimeError`` at once, likewise naming itself, the peer and the step.
"""

from __future__ import annotations

import datetime
import math
import os

import torch
import torch.distributed as dist

__all__ = ["Transport", "TorchTransport", "LocalRing", "LocalTransport", "Transfer", "drive", "run_local",
           "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "ring_timeout", "set_ring_timeout"]

TIMEOUT_ENV = "STRIPED_SP_RING_TIMEOUT_S"
#: the ring timeout unless set otherwise: well below gloo's 30 minutes, above any sane ring step
DEFAULT_TIMEOUT_S = 600.0
_configured_s: float | None = None
#: what gloo says when the peer's process has gone ("Connection closed by peer", "Connection reset by peer")
_PEER_GONE = ("Connection closed", "Connection reset", "Broken pipe", "closed by peer", "Socket closed")


def _seconds(value, source: str) -> float:
    try:
        seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else float(value)
    except (TypeError, ValueError):
        seconds = float("nan")
    if isinstance(value, bool) or not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{source}={value!r} must be a positive, finite number of seconds")
    return seconds


def set_ring_timeout(seconds: float | None) -> None:
    """The process-wide ring timeout in seconds (``None``: back to ``$STRIPED_SP_RING_TIMEOUT_S`` or
    the default).  ``ValueError`` unless positive and finite."""
    global _configured_s
    _configured_s = None if seconds is None else _seconds(seconds, "ring timeout")


def ring_timeout(timeout: float | datetime.timedelta | None = None) -> datetime.timedelta:
    """The ring timeout: ``timeout`` (seconds or a ``timedelta``) when given, else the configured one
    (module docstring); ``ValueError`` naming the source of a bad value."""
    if timeout is not None:
        return datetime.timedelta(seconds=_seconds(timeout, "timeout"))
    if _configured_s is not None:
        return datetime.timedelta(seconds=_configured_s)
    env = os.environ.get(TIMEOUT_ENV)
    if env is not None:
        return datetime.timedelta(seconds=_seconds(env, f"${TIMEOUT_ENV}"))
    return datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)


class Transfer:
    """Receives in flight from the previous rank; :meth:`wait` returns the received tensors.
    ``peers``: ``(to, frm)``, the ranks sent to and received from (named by an error)."""

    def __init__(self, requests, sent: list[torch.Tensor], received: list[torch.Tensor], ring: "TorchTransport" = None,
                 what: str = "a ring step", peers: tuple[int, int] | None = None):
        self._requests = requests
        self._sent = sent  # kept alive until the sends complete
        self._received = received
        self._ring, self._what, self._peers = ring, what, peers

    def settle(self) -> None:
        """Complete the transfer whatever happened meanwhile (a failing rank leaves no message half-sent)."""
        self.wait()

    def wait(self) -> list[torch.Tensor]:
        ring = self._ring
        timeout = ring.timeout if ring is not None and self._received and self._received[0].device.type == "cpu" \
            else None
        # NCCL coalesces a batch of sends and receives into one work: which of them failed is unknown
        coalesced = len(self._requests) != len(self._sent) + len(self._received)
        for i, req in enumerate(self._requests):
            try:
                if timeout is None:
                    req.wait()
                else:
                    req.wait(timeout=timeout)
            except RuntimeError as err:  # a timeout, or a peer gone mid-transfer ("Connection closed by peer")
                if ring is None:
                    raise
                raise ring.stuck_error(self._what, sending=None if coalesced else i < len(self._sent), err=err,
                                       peers=self._peers,
                                       waited=timeout is not None) from err
        self._sent = []
        return self._received


class Transport:
    """The interface: ``rank``, ``world_size``, :meth:`shift`."""

    rank: int = 0
    world_size: int = 1

    def shift(self, tensors: list[torch.Tensor], what: str = "a ring step", hops: int = 1,
              recv_rows: int | None = None):
        raise NotImplementedError


class TorchTransport(Transport):
    """A ring over the ranks of ``group``: sends go to the next rank, receives come from the
    previous one.  Neighbours are *global* ranks, taken from the group itself.  ``None``: a ring
    of this rank alone (it never sends).  ``timeout``: each transfer's wait (CPU tensors; ``None``:
    the process group's own)."""

    def __init__(self, group: dist.ProcessGroup | None, timeout: datetime.timedelta | None = None):
        self.group = group
        self.timeout = timeout
        if group is None:  # a ring of one rank (hierarchical CP with every rank in one Ulysses group)
            self.rank, self.world_size = 0, 1
            return
        ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.world_size = len(ranks)
        self.next_rank = ranks[(self.rank + 1) % self.world_size]
        self.prev_rank = ranks[(self.rank - 1) % self.world_size]

    def shift(self, tensors: list[torch.Tensor], what: str = "a ring step", hops: int = 1,
              recv_rows: int | None = None) -> Transfer:
        """Post the send of ``tensors`` to the next rank and receives of same-shaped tensors from
        the previous one into fresh buffers (the double buffer); returns at once.  ``what`` names
        the step in a timeout's message (``"forward step 2 of 4"``).  ``hops``: send that many
        ranks ahead instead (and receive from as many behind), for a ring cut short.
        ``recv_rows``: the received tensors have this size in dim 1 (blocks of unequal rows)."""
        sent = [t.contiguous() for t in tensors]
        if recv_rows is None:
            received = [torch.empty_like(t) for t in sent]
        else:
            received = [t.new_empty((t.size(0), recv_rows, *t.shape[2:])) for t in sent]
        to, frm = self.next_rank, self.prev_rank
        if hops % self.world_size != 1:
            ranks = dist.get_process_group_ranks(self.group)
            to, frm = ranks[(self.rank + hops) % self.world_size], ranks[(self.rank - hops) % self.world_size]
            what = f"{what}, {hops} ranks ahead: to rank {to}, from rank {frm}"
        ops = [dist.P2POp(dist.isend, t, to, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, frm, self.group) for r in received]
        try:
            requests = dist.batch_isend_irecv(ops)
        except RuntimeError as err:  # a peer already gone: gloo refuses the post ("Connection closed by peer")
            raise self.stuck_error(what, sending=None, err=err, peers=(to, frm), waited=False, posting=True) from err
        return Transfer(requests, sent, received, self, what, peers=(to, frm))

    def stuck_error(self, what: str, sending: bool | None, err: BaseException,
                    peers: tuple[int, int] | None = None, waited: bool = True, posting: bool = False) -> Exception:
        """The error for a transfer that failed or timed out: names this rank, the peer and the step.
        ``sending``: the send failed (``False``: the receive; ``None``: either, as one coalesced
        transfer (NCCL), or ``posting`` it);
        ``peers``: ``(to, frm)`` (default: the next and previous ranks); ``waited``: the wait had
        the ring timeout (gloo), else the process group's own applied."""
        to, frm = peers if peers is not None else (self.next_rank, self.prev_rank)
        me = f"rank {dist.get_rank()} (rank {self.rank} of its CP group of {self.world_size})"
        peer = (f"sending to rank {to}" if sending else f"receiving from rank {frm}" if sending is False
                else f"posting the transfer to rank {to} and from rank {frm}" if posting
                else f"in the transfer to rank {to} and from rank {frm}")
        text = str(err)
        if "imed out" in text or "timeout" in text:
            waited_for = (f"more than {self.timeout.total_seconds():g} s" if waited and self.timeout is not None
                          else "past the process group's timeout")
            return TimeoutError(
                f"ring_attention: {me} waited {waited_for} {peer} in {what}: "
                f"that peer is stuck or gone (set the ring timeout with ring_attention(timeout=), "
                f"${TIMEOUT_ENV}, --context-parallel-timeout-s or context_parallel.timeout_s)")
        first = text.splitlines()[0] if text else repr(err)
        if any(mark in text for mark in _PEER_GONE):
            return RuntimeError(
                f"ring_attention: {me} failed {peer} in {what}: that peer is gone, its process may have exited "
                f"(killed, out of memory, or an error of its own): look at its log for the first error "
                f"(gloo: {first})")
        return RuntimeError(f"ring_attention: {me} failed {peer} in {what}: {first}")


def drive(steps):
    """Run an executor generator on a blocking transport (it waits for its transfers itself; a
    yield only marks where it is about to); returns the generator's result."""
    try:
        while True:
            next(steps)
    except StopIteration as done:
        return done.value


class LocalRing:
    """``world_size`` ranks in one process: per (source, destination) a queue of tensors in flight.
    ``copy``: a receiver gets copies (as over a wire), else the sender's tensors themselves."""

    def __init__(self, world_size: int, copy: bool = True):
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        self.world_size, self.copy = world_size, copy
        self.queues: dict = {}
        self.sent_bytes = 0
        self.transports = [LocalTransport(self, r) for r in range(world_size)]

    def post(self, src: int, dst: int, tensors: list[torch.Tensor]) -> None:
        self.sent_bytes += sum(t.numel() * t.element_size() for t in tensors)
        moved = [t.clone() if self.copy else t for t in tensors]
        self.queues.setdefault((src, dst), []).append(moved)

    def take(self, src: int, dst: int, what: str) -> list[torch.Tensor]:
        queue = self.queues.get((src, dst))
        if not queue:
            raise RuntimeError(f"local ring: rank {dst} waits in {what} for rank {src}, which sent nothing: "
                               "the ranks' plans disagree")
        return queue.pop(0)


class _LocalTransfer:
    def __init__(self, ring: LocalRing, src: int, dst: int, what: str, recv_rows: int | None):
        self.ring, self.src, self.dst, self.what, self.recv_rows = ring, src, dst, what, recv_rows

    def wait(self) -> list[torch.Tensor]:
        got = self.ring.take(self.src, self.dst, self.what)
        if self.recv_rows is not None and any(t.size(1) != self.recv_rows for t in got):
            raise RuntimeError(f"local ring: rank {self.dst} expected {self.recv_rows} rows in {self.what}, "
                               f"rank {self.src} sent {[t.size(1) for t in got]}")
        return got

    def settle(self) -> None:
        pass


class LocalTransport(Transport):
    """Rank ``rank`` of a :class:`LocalRing`."""

    def __init__(self, ring: LocalRing, rank: int):
        self.ring, self.rank, self.world_size = ring, rank, ring.world_size

    def shift(self, tensors, what="a ring step", hops=1, recv_rows=None):
        n = self.world_size
        self.ring.post(self.rank, (self.rank + hops) % n, [t.contiguous() for t in tensors])
        return _LocalTransfer(self.ring, (self.rank - hops) % n, self.rank, what, recv_rows)


def run_local(generators: list, clock=None, timer=None) -> list:
    """Run one executor generator per rank of a :class:`LocalRing` side by side: each runs to the
    point where it is about to wait for a transfer, and once every rank is there (so every send of
    the round is posted) all resume: a round per transfer.  ``clock(rank, round, seconds)``, when
    given, gets each rank's part of each round as measured by ``timer`` (default
    ``time.perf_counter``; ``time.thread_time`` for CPU time): its compute, a transfer being only a
    hand-over.  Returns each rank's result."""
    import time

    timer = timer or time.perf_counter
    results = [None] * len(generators)
    live, rnd = list(range(len(generators))), 0
    while live:
        waiting = []
        for r in live:
            t0 = timer()
            try:
                next(generators[r])
                waiting.append(r)
            except StopIteration as done:
                results[r] = done.value
            if clock is not None:
                clock(r, rnd, timer() - t0)
        live = waiting
        rnd += 1
    return results
