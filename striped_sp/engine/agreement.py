"""Cross-rank agreement: every rank of a group checks, once per call signature, that all ranks
called with the same arguments, so that ranks that disagree raise a ``ValueError`` naming the
field instead of exchanging mismatched ring messages (silently wrong gradients, a crash or a hang).

:func:`agree` is the one routine.  A caller names its signature as ``(field, value)`` pairs
(shapes, dtype, layout key, mask, ...).  The first time a group sees a signature, its ranks run a
fixed protocol that every rank follows whatever its own values, so that ranks that disagree never
wait on each other:

1. one all-gather of two int64 per rank: a status (0: ready; 1: this rank's own argument checks
   failed) and a 64-bit digest of the signature (blake2b, the same on every process);
2. when a status is 1 (every rank sees the same gathered table, so all take this step or none): an
   all-gather of the byte lengths, then one of the padded texts of the failed ranks' errors; every
   other rank raises ``ValueError`` "rank r of the group refused: <its error>";
3. only when every status is 0 and the digests differ (likewise all or none): the same two
   all-gathers of the readable field values; each rank then names the fields that differ and both
   values.

An agreed signature is kept in a small per-group LRU cache (:data:`CACHE_SIZE` entries), so the
steady state sends nothing.  Ranks that call with the same sequence of signatures hold the same
cache and skip the exchange together.  What the cache cannot see: one rank calling with a
signature it agreed on before while another calls with a new one (the first skips the check, the
second waits for it); such a rank is then stopped by the exchange's timeout (the ring timeout,
:func:`striped_sp.engine.transport.ring_timeout`), with a message that says so.

``$STRIPED_SP_CHECK_RANKS``: ``1`` (the default) checks, ``0`` turns the check off (ranks that
disagree then go unnoticed), ``always`` checks every call without the cache (one small exchange per
call: closes the gap above, for bringing up a launch script); anything else is a ``ValueError``
naming the variable.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import hashlib
import json
import os
from typing import Any, Sequence

import torch
import torch.distributed as dist

# torch 2.11 has no ``all_gather_single`` (newer releases add it); ``all_gather_into_tensor`` is the
# same flat gather there
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

from .transport import _PEER_GONE, ring_timeout

__all__ = ["CHECK_RANKS_ENV", "CACHE_SIZE", "check_ranks_enabled", "per_call_checks_enabled", "agree", "agreeing",
           "gather_rows", "clear_cache"]

CHECK_RANKS_ENV = "STRIPED_SP_CHECK_RANKS"
#: agreed signatures kept per group (an LRU): more than the distinct attention calls of one step
CACHE_SIZE = 64
_VALUE_CHARS = 200  # a field's readable value is cut to this many characters (its digest is not)
_CACHES: dict = {}  # group key -> OrderedDict(signature -> None)


def check_ranks_enabled() -> bool:
    """``$STRIPED_SP_CHECK_RANKS``: unset or ``1``: check (the default); ``always``: check every call;
    ``0``: off; else ``ValueError``."""
    value = os.environ.get(CHECK_RANKS_ENV, "1")
    if value not in ("0", "1", "always"):
        raise ValueError(f"${CHECK_RANKS_ENV}={value!r} must be '1' (check that the ranks agree once per "
                         "signature, the default), 'always' (check every call) or '0' (no check)")
    return value != "0"


def per_call_checks_enabled() -> bool:
    """Whether the opt-in checks that exchange a message on *every* call run (the Hugging Face
    attention's own argument checks, the data loader's same-batch check): ``$STRIPED_SP_CHECK_RANKS``
    set to ``1`` or ``always``; unset, empty or ``0``: off; anything else: ``ValueError``."""
    value = os.environ.get(CHECK_RANKS_ENV, "")
    if value not in ("", "0", "1", "always"):
        raise ValueError(f"${CHECK_RANKS_ENV}={value!r} must be '1' (check that the ranks agree once per "
                         "signature, the default), 'always' (check every call) or '0' (no check)")
    return value in ("1", "always")


def clear_cache() -> None:
    """Forget every agreed signature (each group checks its next call again)."""
    _CACHES.clear()


def _group_key(group) -> tuple:
    return (id(group), tuple(dist.get_process_group_ranks(group)))


def _hashable(value: Any) -> Any:
    """``value`` as a dict key: lists become tuples (one level: pass tuples of tuples, not lists of
    lists); everything else (ints, strings, dtypes, tuples, ``torch.Size``) is used as is."""
    return tuple(value) if type(value) is list else value


def _digest(text: str) -> int:
    """A signed 64-bit digest of ``text``, the same on every process (unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _readable(value: Any) -> str:
    text = repr(tuple(value)) if isinstance(value, torch.Size) else repr(value)
    return text if len(text) <= _VALUE_CHARS else text[:_VALUE_CHARS - 3] + "..."


def _all_gather(mine: torch.Tensor, group, timeout: datetime.timedelta | None, what: str,
                skipped: bool = True) -> torch.Tensor:
    """``[world_size, *mine.shape]``: every rank's ``mine``; a peer that does not join within
    ``timeout`` (``None``: the ring timeout; CPU tensors, gloo) raises ``TimeoutError``, a peer whose
    process exited (gloo: "Connection closed by peer") ``RuntimeError``, both naming this rank and
    ``what``.  ``skipped``: a peer may have skipped this exchange with a signature agreed on before
    (``False`` on a group's first agreement: then the timeout's message names only a stuck peer)."""
    if timeout is None:  # not the group's own (gloo: 30 minutes; Megatron's groups likewise)
        timeout = ring_timeout()
    n = dist.get_world_size(group)
    every = torch.empty(n * mine.numel(), dtype=mine.dtype, device=mine.device)  # gloo: concatenated only
    try:
        work = _all_gather_flat(every, mine.reshape(-1), group=group, async_op=True)
        if timeout is not None and mine.device.type == "cpu":
            work.wait(timeout=timeout)
        else:
            work.wait()
    except RuntimeError as err:
        me = f"rank {dist.get_rank(group)} of the group"
        text = str(err)
        if "imed out" not in text and "timeout" not in text:
            first = text.splitlines()[0] if text else repr(err)
            if not any(mark in text for mark in _PEER_GONE):
                raise RuntimeError(f"{what}: {me} failed to exchange the argument check: {first}") from err
            raise RuntimeError(
                f"{what}: {me} failed to exchange the argument check with the other ranks: a peer is gone, its "
                "process may have exited (killed, out of memory, or an error of its own): look at the other ranks' "
                f"logs for the first error (gloo: {first})") from err
        waited = f"more than {timeout.total_seconds():g} s" if mine.device.type == "cpu" else "past the group's timeout"
        if not skipped:
            raise TimeoutError(
                f"{what}: {me} waited {waited} for the other ranks to check their arguments: a peer is stuck or "
                "gone (it has not reached this call, or its process died): look at the other ranks' logs for where "
                "they are or their first error") from err
        raise TimeoutError(
            f"{what}: {me} waited {waited} for "
            "the other ranks to check their arguments (a peer is stuck or gone, or it skipped the check because "
            "it called with a signature the group had agreed on before while this rank called with a new one: "
            "the ranks were called with different arguments)") from err
    return every.view(n, *mine.shape)


def _padded_bytes(text: str, device) -> torch.Tensor:
    return torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)


def _gather_texts(text: str, group, device, timeout, what: str) -> list[str]:
    """Every rank's ``text``, in group rank order: two all-gathers (the byte lengths, then the padded
    bytes); every rank must take this step (they all decided so from the same gathered table)."""
    data = _padded_bytes(text, device)
    lengths = _all_gather(torch.tensor([data.numel()], dtype=torch.int64, device=device), group, timeout,
                          what, skipped=False).view(-1).tolist()  # every rank took step 1: none skipped
    padded = torch.zeros(max(max(lengths), 1), dtype=torch.uint8, device=device)
    padded[:data.numel()] = data
    every = _all_gather(padded, group, timeout, what, skipped=False).cpu()
    return [bytes(every[r, :lengths[r]].tolist()).decode(errors="replace") for r in range(len(lengths))]


def _describe_mismatch(fields: Sequence[tuple[str, Any]], group, device, timeout, what: str) -> str:
    """Step 2: every rank's readable values (and per-field digests); the differing fields named."""
    mine = json.dumps([[name, _readable(value), _digest(repr(_hashable(value)))] for name, value in fields])
    tables = [json.loads(text) for text in _gather_texts(mine, group, device, timeout, what)]
    base = {name: (value, d) for name, value, d in tables[0]}
    lines = []  # the same text on every rank: each rank that differs from rank 0, field by field
    for r, table in enumerate(tables[1:], start=1):
        theirs = {name: (value, d) for name, value, d in table}
        for name, (value0, d0) in base.items():
            if name not in theirs or theirs[name][1] != d0:
                lines.append(f"rank {r} passed {name}={theirs.get(name, ('(nothing)',))[0]}, rank 0 passed {value0}")
    return "; ".join(lines) or "the signatures differ but no single field does (different field lists)"


def _refusal(error: BaseException) -> str:
    """What a rank whose own checks failed tells its peers: the error's type and message, cut short."""
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= 4 * _VALUE_CHARS else text[:4 * _VALUE_CHARS - 3] + "..."


def gather_rows(group, values: Sequence[int], *, what: str, device: torch.device | str | None = None,
                timeout: datetime.timedelta | None = None) -> list[list[int]]:
    """Every rank's ``values`` (int64, the same count on every rank), in group rank order: one
    all-gather, ``TimeoutError`` naming ``what`` when a peer does not join within ``timeout``
    (gloo; ``None``: the ring timeout).  The exchange under :func:`agree`, for callers that compare their own table (the data
    loader's batch digests)."""
    if group is None:
        group = dist.group.WORLD
    device = torch.device("cpu") if device is None else torch.device(device)
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    return _all_gather(mine, group, timeout, what, skipped=False).tolist()  # every caller meets every time


def agree(group, fields: Sequence[tuple[str, Any]] | None, *, what: str = "ring_attention",
          error: BaseException | None = None, device: torch.device | str | None = None,
          timeout: datetime.timedelta | None = None, enabled: bool | None = None, cached: bool = True) -> None:
    """Raise ``ValueError`` on every rank of ``group`` unless every rank passed the same ``fields``.

    Args:
        group: the process group (``None``: the default group); of size 1: nothing to check.
        fields: this rank's signature as ``(name, value)`` pairs, the same names in the same order on
            every rank; values hashable (lists are taken as tuples), compared by ``repr`` across ranks.
            ``None`` when ``error`` is given.  The per-call cost on a known signature is building
            this tuple and one dict look-up.
        what: the caller's name, at the head of every message.
        error: this rank's own argument check failed: tell the others (their ``ValueError`` names this
            rank), then raise ``error`` here.  Raised also when no peer joins within ``timeout``.
        device: where the exchange's small tensors live (the caller's: CUDA for NCCL).
        timeout: how long to wait for the peers (gloo); ``None``: the ring timeout
            (:func:`striped_sp.engine.transport.ring_timeout`; on CUDA the group's own applies).
        enabled: ``None``: :func:`check_ranks_enabled`.
        cached: ``False``: exchange on every call, agreed before or not (for per-call checks whose
            peers may have failed where this rank passed: they must always meet).

    Sends nothing when the check is off, on one rank, or for a signature the group agreed on before
    (this rank's cache; see the module docstring).  ``TimeoutError`` when a peer never joins.
    """
    if enabled is None:
        enabled = check_ranks_enabled()
    if group is None:
        group = dist.group.WORLD
    device = torch.device("cpu") if device is None else torch.device(device)
    if not enabled or dist.get_world_size(group) == 1 or _tracing(device):
        if error is not None:
            raise error
        return
    cache = _CACHES.setdefault(_group_key(group), collections.OrderedDict())
    if error is None:
        signature = tuple([(name, _hashable(value)) for name, value in fields])
        if cached and signature in cache and os.environ.get(CHECK_RANKS_ENV) != "always":
            cache.move_to_end(signature)
            return
        status, digest = 0, _digest(repr(signature))
    else:
        status, digest = 1, 0
    try:
        table = _all_gather(torch.tensor([status, digest], dtype=torch.int64, device=device), group, timeout,
                            what, skipped=bool(cache)).tolist()  # the group's first agreement: none skipped
    except (TimeoutError, RuntimeError):  # a peer stuck or gone
        if error is not None:
            raise error from None
        raise
    failed = [r for r, (s, _) in enumerate(table) if s]
    if failed:  # every rank sees the same table: all take this step, and each failed rank's cause reaches all
        try:
            causes = _gather_texts("" if error is None else _refusal(error), group, device, timeout, what)
        except (TimeoutError, RuntimeError):
            if error is not None:
                raise error from None
            raise
        if error is not None:
            raise error
        raise ValueError(f"{what}: " + "; ".join(f"rank {r} of the group refused: {causes[r]}" for r in failed)
                         + " (no rank started the ring)")
    if error is not None:  # a table that does not show this rank's own failure (a fake or broken group): still its own
        raise error
    if any(d != table[0][1] for _, d in table):
        detail = _describe_mismatch(fields, group, device, timeout, what)
        raise ValueError(f"{what}: the ranks of the group were called with different arguments: {detail}. "
                         "Every rank must pass the same values: ranks that disagree would compute wrong gradients or hang")
    if not cached:
        return
    cache[signature] = None
    if len(cache) > CACHE_SIZE:
        cache.popitem(last=False)


@contextlib.contextmanager
def agreeing(group, *, what: str = "ring_attention", device=None, timeout=None, enabled: bool | None = None,
             cached: bool = True):
    """Run a block of argument checks: an exception raised inside (of any type) is told to the group's
    other ranks (:func:`agree` with ``error=``: they raise ``ValueError`` "rank r of the group refused:
    ..." with its type and message) before it propagates, so that they raise too instead of waiting
    for this rank.  With ``cached=False`` a block that passes also joins the exchange
    (every rank meets on every call)."""
    try:
        yield
    except Exception as err:  # of any type (a TypeError, a ZeroDivisionError): the peers must not wait
        agree(group, None, what=what, error=err, device=device, timeout=timeout, enabled=enabled, cached=cached)
        raise
    if not cached:
        agree(group, (), what=what, device=device, timeout=timeout, enabled=enabled, cached=False)


def _tracing(device: torch.device) -> bool:
    """Inside ``torch.compile`` tracing or a CUDA graph capture: no exchange can run.  The capture
    is asked about only for CUDA tensors (asking initialises CUDA, which a CPU run may not have)."""
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and getattr(compiler, "is_compiling", lambda: False)():
        return True
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
