"""Mirrored ("snake") dealing of stripes, zigzag's order, as a striped plan parameter.

A striped layout deals the stripes of its sub-row (the documents it does not keep whole, in row
order; the whole row without documents) to the ranks.  Round-robin (``order="round"``, the paper's):
stripe ``g`` to rank ``g mod N``.  Mirrored (``order="mirror"``): ranks ``0 .. N-1``, then
``N-1 .. 0``, then ``0 .. N-1`` again: in every period of ``2N`` stripes rank ``r`` holds stripes
``r`` and ``2N-1-r``.  Zigzag (Megatron-LM / Transformer Engine) is the mirrored order with ``2N``
stripes of ``S / 2N`` on a row; per-document stripes (``stripe_size="doc"``,
:mod:`striped_sp.plan.doc_stripes`) deal every document so.  Under round-robin a rank's query stripe
sees the source's stripe of the same round whole when the source rank is lower and not at all when
it is higher, so on each ring step some ranks hold ``k (k + 1) / 2`` key stripes' squares for their
``k`` query stripes and others ``k (k - 1) / 2``; mirrored, every rank holds ``k^2 / 2`` on every step
after the first (``k`` even), which is zigzag's balance at any stripe size.

Like every striped parameter it is data: it changes the run tables (:func:`mirrored_rows`, the
room the striped stripes leave each rank, :func:`striped_room`), and every path that reads the
layout's runs (the engine's masked plans, ``shard`` / ``positions``, the adapters, the hybrid
mixers' natural order) follows.
"""

from __future__ import annotations

import torch

__all__ = ["ORDERS", "check_order", "stripe_ranks", "mirrored_rows", "striped_room"]

#: the dealing orders of a striped layout's stripes
ORDERS = ("round", "mirror")


def check_order(order) -> str:
    """``"round"`` or ``"mirror"``; else ``ValueError`` naming the value and the rule."""
    if isinstance(order, str) and order in ORDERS:
        return order
    raise ValueError(f"layout parameter order={order!r} must be 'round' (stripe g to rank g mod N, the paper's) or "
                     "'mirror' (ranks 0..N-1 then N-1..0, zigzag's order)")


def stripe_ranks(g: torch.Tensor, world_size: int, order: str = "round") -> torch.Tensor:
    """The rank of stripe ``g`` (int64 tensor of stripe indices in the sub-row) under ``order``."""
    n = world_size
    if order == "round" or n == 1:
        return g % n
    return torch.where((g // n) % 2 == 0, g % n, n - 1 - g % n)


def striped_room(striped_tokens: int, world_size: int, stripe: int, local: int, order: str = "round") -> list[int]:
    """Each rank's room left for whole documents once ``striped_tokens`` tokens of the sub-row are dealt
    in stripes of ``stripe``: whole rounds of ``N`` stripes, then a part round (ranks ``0, 1, ..``
    under round-robin, or after an odd number of rounds under the mirror ``N-1, N-2, ..``)."""
    n = world_size
    rounds, rest = divmod(striped_tokens, n * stripe)
    full, part = divmod(rest, stripe)  # `full` ranks get a stripe more, the next part of one
    room = local - rounds * stripe
    capacity = [room - stripe] * full + [room - part] + [room] * (n - full - 1)
    if order == "mirror" and rounds % 2 == 1:
        capacity.reverse()
    return capacity[:n]


def mirrored_rows(start: torch.Tensor, length: torch.Tensor, world_size: int, stripe: int) -> torch.Tensor:
    """The runs of documents (first positions ``start``, lengths ``length``, int64, in sub-row order)
    dealt as one sub-row in mirrored stripes of ``stripe`` tokens: int64 rows ``(rank, first position,
    count, step)`` grouped by rank in rank order, each rank's in sub-row order.  Stripes of 1: per
    document and rank the two runs of step ``2N`` of its sub-row offsets ``r`` and ``2N-1-r`` mod ``2N``
    (ordered by first position); larger stripes: one run of step 1 per piece of a stripe."""
    n = world_size
    offset = torch.cumsum(length, 0) - length
    if stripe == 1:
        ranks = torch.arange(n)
        rows = []
        for residue in (ranks, 2 * n - 1 - ranks):
            t0 = (residue - offset[:, None]) % (2 * n)  # [docs, N]: the first such token of each document
            rows.append(torch.stack([ranks.expand_as(t0), start[:, None] + t0,
                                     torch.clamp((length[:, None] - t0 + 2 * n - 1) // (2 * n), min=0),
                                     torch.full_like(t0, 2 * n)], 2))
        both = torch.stack(rows, 2)  # [docs, N, 2, 4]
        swap = both[:, :, 0, 1] > both[:, :, 1, 1]  # the earlier run first
        both = torch.where(swap[:, :, None, None], both.flip(2), both)
        both = both.transpose(0, 1).reshape(n, -1, 4)  # [N, docs * 2, 4]: rank, then sub-row order
        return both[both[:, :, 2] > 0]
    first_g = offset // stripe
    pieces = torch.where(length > 0, (offset + length - 1) // stripe - first_g + 1, 0)
    doc = torch.repeat_interleave(torch.arange(len(length)), pieces)
    g = first_g[doc] + torch.arange(len(doc)) - (torch.cumsum(pieces, 0) - pieces)[doc]
    lo = torch.maximum(g * stripe, offset[doc])
    hi = torch.minimum((g + 1) * stripe, (offset + length)[doc])
    rank = stripe_ranks(g, n, "mirror")
    rows = torch.stack([rank, start[doc] + lo - offset[doc], hi - lo, torch.ones_like(g)], 1)
    return rows[torch.sort(rank, stable=True).indices]

