"""State passing for a recurrent token mixer: the layout's tokens re-laid into contiguous chunks,
and the small collectives that join the chunks (a convolution's halo, the per-head summaries).

A recurrence whose every step is affine in its state (Mamba2's scan, a gated delta net, a short
convolution's window) needs no rank to see the whole sequence.  Rank ``r`` takes the ``S / N``
consecutive tokens ``[r S/N, (r+1) S/N)`` of the row (:func:`to_chunks`: one all-to-all of its
``S/N x C`` inputs; the layout's permutation folded into its indices), runs the model's own kernel on
them from a zero state, and the ranks exchange one small summary per head
(:func:`gather_summaries`: an all-gather of a few KiB per head, independent of ``S``); each rank folds
its predecessors' summaries into its entry state and corrects its outputs
(:mod:`.state_fold`), and :func:`from_chunks` returns them to the layout.  A convolution of width
``k`` takes the previous chunk's last ``k - 1`` inputs (:func:`halo`).

Packed rows: :class:`ContiguousChunks` knows, from the row's document boundaries, where documents
start inside each chunk: a chunk's entry state (and its halo rows) reach only the tokens of the
document that continues from the previous chunk (``cont``), a chunk that contains a document start
passes no state through (``through``), and the kernels get the chunk's own ``seq_idx``.

Every collective here is an autograd Function whose backward is the mirror collective (all-to-all
back, reduce-scatter), and every rank builds the same graph (rank 0's fold multiplies by zeros
rather than skipping), so the ranks' backward collectives come in the same order.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from .agreement import _all_gather_flat  # all_gather_single where torch has it
from .natural_order import natural_order

__all__ = ["ContiguousChunks", "contiguous_chunks", "to_chunks", "from_chunks", "gather_summaries", "halo"]


class ContiguousChunks:
    """The host-side facts of one row shape (``seq_len`` tokens, ``world_size`` ranks, the layout and
    the row's document ``bounds``) for rank ``rank``: the all-to-all's counts and indices, and the
    documents of every rank's chunk.  Built once per row shape (cached by :func:`contiguous_chunks`).

    ``length``: the chunk's tokens (``S / N``); ``start``: its first position; ``cont`` ``[T]`` (bool):
    the tokens the entry state reaches (no document starts between the chunk's start and them);
    ``through_all`` ``[N]`` (bool): the chunks the state crosses whole; ``seq_idx`` ``[T]`` (int32): the
    chunk's documents numbered from 0; ``cu_seqlens``: their boundaries in the chunk (int32);
    ``halo_keep(k)``: which of the previous ``k - 1`` tokens belong to the chunk's first document."""

    def __init__(self, seq_len: int, world_size: int, rank: int, layout: str, bounds=None, documents: bool = True):
        order = natural_order(seq_len, world_size, rank, layout, bounds)
        self.layout, self.bounds = layout, bounds
        n, t = world_size, seq_len // world_size
        self.seq_len, self.world_size, self.rank, self.length, self.start = seq_len, n, rank, t, rank * t
        every = order.rank_major.reshape(n, t)                   # every rank's positions, local order
        mine = every[rank]
        self.send_index = torch.argsort(mine, stable=True)      # my tokens by position: by destination
        self.send_counts = torch.bincount(mine // t, minlength=n).tolist()
        owner = every // t                                       # the chunk each token of each rank goes to
        got = [torch.sort(every[i][owner[i] == rank]).values for i in range(n)]
        self.recv_counts = [len(g) for g in got]
        received = torch.cat(got)                                # positions in the received order
        self.recv_index = torch.argsort(received)               # chunk order from the received order
        self.back_index = received - self.start                 # chunk rows in the order each rank takes
        self.restore_index = torch.argsort(self.send_index)     # local order from by-position order
        starts = torch.zeros(seq_len, dtype=torch.bool)
        starts[0] = True
        if documents and bounds:  # every document's first token (one index, no loop per document)
            at = torch.as_tensor(bounds, dtype=torch.long)
            starts[at[(at > 0) & (at < seq_len)]] = True
        self._starts = starts
        per_chunk = starts.reshape(n, t)
        self.through_all = ~per_chunk.any(dim=1)
        resets = per_chunk[rank]
        counted = torch.cumsum(resets.to(torch.int32), 0)
        self.cont = counted == 0
        self.seq_idx = (counted - counted[0]).to(torch.int32)
        firsts = torch.nonzero(resets[1:]).flatten() + 1
        self.cu_seqlens = torch.cat((torch.tensor([0]), firsts, torch.tensor([t]))).to(torch.int32)
        self.has_documents = bool(per_chunk.sum() > 1)
        self._on: dict = {}
        self._keep: dict = {}

    def halo_keep(self, width: int, device=None, dtype=torch.float32) -> torch.Tensor:
        """``[width]`` (``dtype`` on ``device``, made once): 1 for the ``width`` tokens before the chunk that
        are of its first document, else 0 (all 0 on rank 0)."""
        key = (width, str(torch.device(device or "cpu")), dtype)
        if key not in self._keep:
            before = torch.arange(self.start - width, self.start)
            later = torch.cumsum(self._starts.flip(0), 0).flip(0)                 # starts at or after p
            after_mine = later[self.start + 1] if self.start + 1 < self.seq_len else 0
            keep = (before >= 0) & (later[before.clamp(min=0) + 1] - after_mine == 0)
            self._keep[key] = keep.to(device=device, dtype=dtype)
        return self._keep[key]

    def without_documents(self) -> "ContiguousChunks":
        """The same row's chunks with no document starts (a model whose kernels reset nowhere)."""
        return contiguous_chunks(self.seq_len, self.world_size, self.rank, self.layout, self.bounds, False)

    def on(self, device) -> "ContiguousChunks":
        """The index and mask tensors on ``device`` (copied once per device)."""
        key = str(torch.device(device))
        if key not in self._on:
            copy = object.__new__(ContiguousChunks)
            copy.__dict__.update(self.__dict__)
            for name in ("send_index", "recv_index", "back_index", "restore_index", "cont", "through_all",
                         "seq_idx", "cu_seqlens"):
                setattr(copy, name, getattr(self, name).to(device))
            copy._on = {key: copy}
            self._on[key] = copy
        return self._on[key]


@functools.lru_cache(maxsize=32)
def contiguous_chunks(seq_len: int, world_size: int, rank: int, layout: str,
                      bounds: tuple | None = None, documents: bool = True) -> ContiguousChunks:
    """The cached :class:`ContiguousChunks` of a row (``bounds``: a packed row's document boundaries
    as a tuple, ``None`` for one sequence; ``documents=False``: the bounds place the tokens, but the
    state crosses them)."""
    if seq_len % world_size:
        raise ValueError(f"state passing: {seq_len} tokens do not split into {world_size} equal chunks")
    return ContiguousChunks(seq_len, world_size, rank, layout, bounds, documents)


def _exchange(x: torch.Tensor, group, out_rows: int, send_counts, recv_counts) -> torch.Tensor:
    """``x`` ``[rows, ...]`` cut into ``send_counts`` pieces (piece ``j`` to rank ``j``) -> ``[out_rows, ...]``:
    rank ``i``'s piece for this rank, rank after rank."""
    x = x.contiguous()
    out = x.new_empty((out_rows, *x.shape[1:]))
    dist.all_to_all_single(out, x, output_split_sizes=recv_counts, input_split_sizes=send_counts, group=group)
    return out


def _chunks(x: torch.Tensor, group, plan: ContiguousChunks) -> torch.Tensor:
    rows = x.index_select(1, plan.send_index).transpose(0, 1)                  # [s, b, ...] by position
    got = _exchange(rows, group, plan.length, plan.send_counts, plan.recv_counts)
    return got.index_select(0, plan.recv_index).transpose(0, 1).contiguous()    # [b, T, ...] chunk order


def _layout(y: torch.Tensor, group, plan: ContiguousChunks) -> torch.Tensor:
    rows = y.index_select(1, plan.back_index).transpose(0, 1)
    got = _exchange(rows, group, plan.length, plan.recv_counts, plan.send_counts)
    return got.index_select(0, plan.restore_index).transpose(0, 1).contiguous()


class _Relayout(torch.autograd.Function):
    """One of the pair; its gradient is the other one."""

    @staticmethod
    def forward(ctx, x, group, plan, to_chunks: bool):
        ctx.group, ctx.plan, ctx.to_chunks = group, plan, to_chunks
        return (_chunks if to_chunks else _layout)(x, group, plan)

    @staticmethod
    def backward(ctx, grad):
        return (_layout if ctx.to_chunks else _chunks)(grad, ctx.group, ctx.plan), None, None, None


def _check_rows(what: str, x: torch.Tensor, plan: ContiguousChunks) -> None:
    if x.dim() < 2 or x.size(1) != plan.length:
        raise ValueError(f"{what}: {tuple(x.shape)} must be [batch, {plan.length} tokens, ...] (a row of "
                         f"{plan.seq_len} tokens on {plan.world_size} ranks)")


def to_chunks(x: torch.Tensor, group, plan: ContiguousChunks) -> torch.Tensor:
    """``x`` ``[b, S/N, ...]`` (this rank's tokens in the layout's local order) -> ``[b, S/N, ...]``: the
    row's tokens ``[r S/N, (r+1) S/N)`` in natural order.  Differentiable (its gradient is :func:`from_chunks`)."""
    _check_rows("to_chunks", x, plan)
    return _Relayout.apply(x, group, plan.on(x.device), True)


def from_chunks(y: torch.Tensor, group, plan: ContiguousChunks) -> torch.Tensor:
    """The inverse of :func:`to_chunks`: this rank's chunk -> this rank's tokens in the layout's order."""
    _check_rows("from_chunks", y, plan)
    return _Relayout.apply(y, group, plan.on(y.device), False)


class _AllGather(torch.autograd.Function):
    """``x`` -> ``[N, *x.shape]`` (every rank's, rank order); backward: the sum over the group of
    every rank's gradient for this rank's ``x`` (reduce-scatter; on gloo an all-reduce and a slice)."""

    @staticmethod
    def forward(ctx, x, group, world_size: int, rank: int):
        ctx.group, ctx.world_size, ctx.rank = group, world_size, rank
        out = x.new_empty(world_size * x.numel())
        _all_gather_flat(out, x.contiguous().reshape(-1), group=group)
        return out.view(world_size, *x.shape)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if dist.get_backend(ctx.group) == "nccl":
            out = grad.new_empty(grad.shape[1:])
            dist.reduce_scatter_tensor(out.view(-1), grad.view(-1), group=ctx.group)
            return out, None, None, None
        dist.all_reduce(grad, group=ctx.group)
        return grad[ctx.rank], None, None, None


def gather_summaries(x: torch.Tensor, group, plan: ContiguousChunks) -> torch.Tensor:
    """Every rank's ``x`` (a chunk's summary: any shape, the same on every rank) -> ``[N, *x.shape]``.
    Differentiable: the gradient of this rank's ``x`` is the sum of every rank's gradient for it."""
    return _AllGather.apply(x, group, plan.world_size, plan.rank)


def halo(x: torch.Tensor, width: int, group, plan: ContiguousChunks) -> torch.Tensor:
    """``x`` ``[b, T, c]`` (this rank's chunk) -> ``[b, width, c]``: the ``width`` tokens before the
    chunk (the previous rank's last ones), zero where they are not of the chunk's first document (and
    on rank 0).  Differentiable; every rank sends its tail, so rank 0 takes part too."""
    if not 0 <= width <= plan.length:
        raise ValueError(f"halo: a convolution window of {width + 1} needs chunks of at least {width} tokens, "
                         f"got {plan.length} ({plan.seq_len} tokens on {plan.world_size} ranks)")
    tails = gather_summaries(x[:, x.size(1) - width:], group, plan)            # [N, b, width, c]
    return tails[(plan.rank - 1) % plan.world_size] * plan.halo_keep(width, x.device, x.dtype)[:, None]
