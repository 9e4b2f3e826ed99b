"""The varlen call format: band segments of a block, as flash-attn's varlen entry points take them.

A :class:`Segments` is what a kernel runs for one varlen call (built by :mod:`striped_sp.plan.masks`);
this module holds the format and its arithmetic, and imports nothing else of the package.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["INF", "Segments"]

#: an unbounded band offset
INF = 1 << 40


@dataclasses.dataclass
class Segments:
    """The segments of one varlen call (the flash-attn varlen convention).

    Segment ``t`` has ``lq = cu_q[t+1] - cu_q[t]`` queries starting at local row ``q_start[t]``
    and ``lk = cu_k[t+1] - cu_k[t]`` keys starting at local row ``k_start[t]`` (``cu_q`` / ``cu_k``
    are the offsets of the segments once packed back to back); query ``x`` sees key ``y`` iff
    ``x + sh - wl <= y <= x + sh + wr`` with ``sh = lk - lq`` (bottom-right aligned; ``-1`` =
    unbounded).  Query rows of different segments are distinct.  int64 CPU tensors; the starts
    default to the packed offsets."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    wl: torch.Tensor
    wr: torch.Tensor
    q_start: torch.Tensor | None = None
    k_start: torch.Tensor | None = None

    def __post_init__(self):
        if self.q_start is None:
            self.q_start = self.cu_q[:-1]
        if self.k_start is None:
            self.k_start = self.cu_k[:-1]

    def __len__(self) -> int:
        return self.wl.numel()

    @property
    def lq(self) -> torch.Tensor:
        return self.cu_q[1:] - self.cu_q[:-1]

    @property
    def lk(self) -> torch.Tensor:
        return self.cu_k[1:] - self.cu_k[:-1]

    def offsets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)``: segment-local ``lo <= y - x <= hi`` (±2**40 when unbounded)."""
        sh = self.lk - self.lq
        lo = torch.where(self.wl < 0, torch.full_like(sh, -INF), sh - self.wl)
        hi = torch.where(self.wr < 0, torch.full_like(sh, INF), sh + self.wr)
        return lo, hi

    def entries(self) -> int:
        """Visible score entries of all segments (per batch row and head)."""
        return int(self.segment_entries().sum())

    def segment_entries(self) -> torch.Tensor:
        """Visible score entries of each segment (int64 ``[segments]``), in closed form; computed
        once (a plan counts them, and its cost model prices them)."""
        cached = self.__dict__.get("_entries")
        if cached is None:
            cached = self.__dict__["_entries"] = _band_entries(self.lq, self.lk, *self.offsets())
        return cached

    def dense_mask(self) -> torch.Tensor:
        """Boolean ``[total_q, total_k]`` mask of the call (for references and small calls)."""
        nq, nk = int(self.cu_q[-1]), int(self.cu_k[-1])
        seg_q = torch.repeat_interleave(torch.arange(len(self)), self.lq)
        seg_k = torch.repeat_interleave(torch.arange(len(self)), self.lk)
        x = torch.arange(nq) - self.cu_q[:-1][seg_q]
        y = torch.arange(nk) - self.cu_k[:-1][seg_k]
        lo, hi = self.offsets()
        d = y.unsqueeze(0) - x.unsqueeze(1)
        same = seg_q.unsqueeze(1) == seg_k.unsqueeze(0)
        return same & (d >= lo[seg_q].unsqueeze(1)) & (d <= hi[seg_q].unsqueeze(1))


def _band_entries(lq, lk, lo, hi) -> torch.Tensor:
    """Per segment, the number of (x, y) in [0,lq) x [0,lk) with lo <= y - x <= hi: in closed form
    (no per-row expansion), as ``F(hi + 1) - F(lo)`` with ``F(a) = sum_x clamp(x + a, 0, lk)``."""
    if lq.numel() == 0:
        return lq
    lo_c, hi_c = torch.clamp(lo, -lq, lk), torch.clamp(hi, -lq, lk)  # same entries, no overflow

    def ramp(m):  # sum over t <= m of clamp(t, 0, lk)
        inside = torch.minimum(torch.clamp(m, min=0), lk)
        return inside * (inside + 1) // 2 + torch.clamp(m - lk, min=0) * lk

    def total(a):  # sum over x in [0, lq) of clamp(x + a, 0, lk)
        return ramp(a + lq - 1) - ramp(a - 1)

    return torch.clamp(total(hi_c + 1) - total(lo_c), min=0)


def _ranges(starts: torch.Tensor, lengths: torch.Tensor, reverse: torch.Tensor | None = None) -> torch.Tensor:
    """Concatenated ``arange(s, s + l)`` for every (s, l) (int64); where ``reverse`` (bool per
    segment) is set, that segment's range backwards, ``s + l - 1`` down to ``s``."""
    total = int(lengths.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64)
    # row j of segment t is starts[t] + (j - offs[t]): one repeat of the per-segment shift, in
    # int32 where the rows fit (its repeat_interleave runs several times faster than int64's)
    offs = torch.cumsum(lengths, 0) - lengths
    small = total < 2**31 and bool(((starts >= 0) & (starts + lengths < 2**31)).all())
    dtype = torch.int32 if small else torch.int64
    if reverse is None or not bool(reverse.any()):
        shift = starts - offs
        return (torch.arange(total, dtype=dtype) + torch.repeat_interleave(shift.to(dtype), lengths,
                                                                          output_size=total)).long()
    # backwards: row j is (s + l - 1 + offs) - j; the sign per row is a cumulative sum of its changes
    # at the segments' starts (no second repeat)
    shift = torch.where(reverse, starts + lengths - 1 + offs, starts - offs).to(dtype)
    flip = reverse.to(dtype)
    change = torch.zeros(total + 1, dtype=dtype).index_add_(0, offs, torch.diff(flip, prepend=flip[:1] * 0))
    sign = 1 - 2 * torch.cumsum(change[:-1], 0, dtype=dtype)
    return (torch.arange(total, dtype=dtype) * sign + torch.repeat_interleave(shift, lengths, output_size=total)).long()
