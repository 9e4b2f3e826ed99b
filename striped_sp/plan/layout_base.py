"""The base of every token layout: :class:`Layout` (which global tokens a rank holds, as runs of one
stride, and the facts the engine and the adapters ask of a layout) and :class:`BlockCall` (one
kernel call inside a ring block: a query slice, a key slice, causal or not, on local indices).

The concrete layouts are in :mod:`striped_sp.plan.chunk_layouts` (``contiguous``, ``zigzag``) and
:mod:`striped_sp.plan.striped_layout` (``striped``); :mod:`striped_sp.plan.layouts` names them all.
"""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["BlockCall", "Layout"]


@dataclasses.dataclass(frozen=True)
class BlockCall:
    """One attention kernel call inside a ring block, on local token indices.

    ``q`` slices the local queries, ``kv`` the visiting keys/values; ``causal`` says whether
    the call uses the (square, diagonal-kept) causal mask or attends to every key.  ``strict``
    marks the striped strict block ``q[1:]`` x ``k[:-1]`` (keys strictly before the queries), which
    kernels with a bottom-right causal mask may run as all queries x ``k[:-1]``
    (:mod:`striped_sp.engine.step`).
    """

    q: slice
    kv: slice
    causal: bool
    strict: bool = False

    def q_len(self, n: int) -> int:
        return len(range(*self.q.indices(n)))

    def kv_len(self, n: int) -> int:
        return len(range(*self.kv.indices(n)))

    def score_entries(self, n: int) -> int:
        """Attention score entries this call computes per (batch, head), for ``n`` local tokens."""
        lq, lk = self.q_len(n), self.kv_len(n)
        if self.causal:
            return lq * (lq + 1) // 2
        return lq * lk


_ALL = slice(None)


class Layout:
    """Base class of a token layout.  Subclasses define ``name``, :meth:`positions` and
    :meth:`causal_plan`; everything else derives from those."""

    name: str = ""
    #: the sequence length must be a multiple of ``world_size * seq_multiple``
    seq_multiple: int = 1

    @property
    def key(self) -> str:
        """The layout and its parameters as one string (equal keys: the same token placement),
        for caches and the cross-rank agreement check."""
        return self.name

    def check_seq_len(self, seq_len: int, world_size: int) -> None:
        """Raise ``ValueError`` unless ``seq_len`` splits evenly over ``world_size`` ranks."""
        if world_size < 1:
            raise ValueError(f"world_size={world_size} must be >= 1")
        unit = world_size * self.seq_multiple
        if seq_len <= 0 or seq_len % unit != 0:
            rule = f"{self.seq_multiple} * world_size" if self.seq_multiple > 1 else "world_size"
            raise ValueError(
                f"sequence length {seq_len} must be a positive multiple of {rule} = {unit} "
                f"for layout '{self.name}' (world_size={world_size})"
            )

    def check_local_len(self, local_len: int) -> None:
        """Raise ``ValueError`` unless ``local_len`` tokens per rank fit this layout."""
        if local_len <= 0 or local_len % self.seq_multiple != 0:
            raise ValueError(
                f"local sequence length {local_len} must be a positive multiple of "
                f"{self.seq_multiple} for layout '{self.name}'"
            )

    def stride(self, world_size: int) -> int:
        """Position step between consecutive local tokens inside one run."""
        return 1

    #: True when :meth:`causal_plan` covers the unmasked ring (else the ring runs masked plans)
    dense_plans: bool = True
    #: True when the token order follows the documents of a packed row (each cut or kept whole by
    #: its own bounds), so data, attention and RoPE must see the same documents, padding included
    places_documents: bool = False
    #: True when a dense causal ring has the striped strict block (keys strictly before the queries,
    #: ``q[1:]`` x ``k[:-1]``), which kernels with a bottom-right causal mask may run aligned
    strict_block: bool = False

    def dense_row(self, seq_len: int, world_size: int) -> bool:
        """Whether a row of ``seq_len`` tokens without documents or a window runs :meth:`causal_plan`
        (the dense plans) rather than the masked plans of its runs: :attr:`dense_plans` unless the
        layout's stripes depend on the row (a striped window hint)."""
        return self.dense_plans

    def document_multiple(self, world_size: int) -> int:
        """Every document of a packed row must be a multiple of this many tokens (1: any length)."""
        return 1

    def runs(self, seq_len: int, world_size: int, rank: int, cu_seqlens=None):
        """This rank's tokens as runs ``(local_start, first_position, count)`` of step
        :meth:`stride`, or ``(local_start, first_position, count, step)`` with a step of their own,
        in local order: a list of tuples or an int64 tensor ``[runs, 3 or 4]``.  Positions
        increase along each run; a layout that places whole documents
        (:class:`~striped_sp.plan.striped_layout.Striped` with a ``doc_placement``) lists its runs out of
        global order."""
        raise NotImplementedError

    def decision(self, seq_len: int, world_size: int, cu_seqlens=None) -> str | None:
        """What this layout runs on a row and why, in one line, where it chooses per row (``None``: a
        fixed layout); recorded in the row's plan (``RingPlan.decision``)."""
        return None

    def run_order(self, seq_len: int, world_size: int, rank: int, cu_seqlens=None):
        """int64 ``[seq_len // world_size]`` when the engine runs this rank's rows in another order
        than the caller holds them (run row ``p`` is the caller's row ``order[p]``), else ``None``
        (the 1-D layouts; :class:`~striped_sp.plan.grouped.GroupedLayout` on a ring of one)."""
        return None

    def ring_steps(self, world_size: int, local_len: int, mask=None) -> int:
        """How many ring steps can hold visible keys (``1 .. world_size``): at step ``t`` rank ``r``
        holds the keys of rank ``r - t``, and a causal window of ``left`` tokens never reaches
        further back than ``ceil(left / block)`` blocks of consecutive tokens (``block``: see
        :meth:`window_block`), so the steps after that carry nothing to compute; documents only
        hide more keys.  Every rank gets the same answer from the same arguments."""
        block = self.window_block(world_size, local_len, mask)
        if mask is None or block is None or mask.right != 0 or mask.left < 0:
            return world_size
        return min(world_size, -(-mask.left // block) + 1)

    def window_block(self, world_size: int, local_len: int, mask=None) -> int | None:
        """The size of the blocks of consecutive tokens this layout deals to ranks round-robin
        (rank ``r`` holds blocks ``r, r + N, ...``), or ``None`` when it does not."""
        return None

    def run_table(self, seq_len: int, world_size: int, rank: int, cu_seqlens=None) -> torch.Tensor:
        """:meth:`runs` as an int64 tensor ``[runs, 4]``: local start, first position, count, step."""
        runs = torch.as_tensor(self.runs(seq_len, world_size, rank, cu_seqlens), dtype=torch.int64)
        if runs.numel() == 0:
            return torch.zeros(0, 4, dtype=torch.int64)
        if runs.dim() == 1:
            runs = runs.view(1, -1)
        if runs.size(1) == 3:
            runs = torch.cat([runs, torch.full((runs.size(0), 1), self.stride(world_size), dtype=torch.int64)], 1)
        return runs

    def all_run_tables(self, seq_len: int, world_size: int, cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's :meth:`run_table` at once: ``(runs [total, 4], runs per rank [N])``, int64,
        rank 0's first."""
        tables = [self.run_table(seq_len, world_size, r, cu_seqlens) for r in range(world_size)]
        sizes = torch.tensor([t.size(0) for t in tables], dtype=torch.int64)
        return (torch.cat(tables) if tables else torch.zeros(0, 4, dtype=torch.int64)), sizes

    def positions(self, seq_len: int, world_size: int, rank: int, cu_seqlens=None) -> torch.Tensor:
        """Global positions (int64, length ``seq_len // world_size``) of rank's tokens, in local
        order (increasing, except where a layout places whole documents).

        ``cu_seqlens`` (document boundaries of the packed row, a list of ints) changes the
        positions of ``zigzag`` and of a striped layout with a ``doc_placement``."""
        self.check_seq_len(seq_len, world_size)
        runs = self.run_table(seq_len, world_size, rank, cu_seqlens)
        count = runs[:, 2]
        run = torch.repeat_interleave(torch.arange(runs.size(0)), count)
        offset = torch.arange(run.numel()) - (torch.cumsum(count, 0) - count)[run]
        return runs[run, 1] + runs[run, 3] * offset

    def causal_plan(self, rank: int, source: int, world_size: int, local_len: int) -> list[BlockCall]:
        raise NotImplementedError

    def plan(
        self, rank: int, source: int, world_size: int, local_len: int, causal: bool = True
    ) -> list[BlockCall]:
        """Kernel calls for the queries of ``rank`` against the keys/values of ``source``.

        Fully masked blocks give an empty list.  Without ``causal`` every block is one full call.
        """
        if not causal:
            return [BlockCall(_ALL, _ALL, False)]
        return self.causal_plan(rank, source, world_size, local_len)

    def flattens_rows(self, local_len: int) -> bool:
        """Whether the rows of a ``[b, local_len]`` shard are this layout's shard of the ``b`` rows laid
        end to end (one packed row, the same rank for every token), so that a batch of rows with
        documents runs as one flattened row.  No by default."""
        return False

    #: True when rank ``r`` holds the contiguous slice ``r*n .. (r+1)*n - 1`` of the row (``n = S / N``),
    #: as a data path that slices the sequence itself gives (Megatron-DeepSpeed's ``get_batch``)
    contiguous_slices: bool = False
