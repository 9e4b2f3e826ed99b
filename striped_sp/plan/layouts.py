"""Token layouts: which global tokens a rank holds, and the kernel calls of each ring block.

A layout is pure data and arithmetic; it never touches a process group.  For the ring, a
layout answers one question: when the queries of rank ``i`` meet the keys/values of rank
``j``, which kernel calls cover exactly the causal part of that block?  The answer is a
list of :class:`BlockCall`, each a query slice, a key slice and a causal flag, on *local*
indices.  Causal calls are always square, so top-left and bottom-right mask alignment agree
(the CPU kernel aligns top-left, flash-attn 2 bottom-right).

Layouts (sequence of ``S`` tokens on ``N`` ranks, ``n = S / N`` tokens per rank):

* ``contiguous``: rank ``r`` holds ``r*n ... (r+1)*n - 1`` (original Ring Attention).
* ``zigzag``: the sequence is cut into ``2N`` chunks; rank ``r`` holds chunks ``r`` and
  ``2N-1-r`` (Megatron-LM / Transformer Engine's load-balanced layout).
* ``striped``: rank ``r`` holds ``r, r+N, r+2N, ...`` (Striped Attention, arXiv 2311.09431).

With packed documents (``cu_seqlens``) ``striped`` and ``contiguous`` keep their positions, while
``zigzag`` follows Transformer Engine's THD rule: every document (padded to a multiple of ``2N``)
is cut into ``2N`` chunks and rank ``r`` holds chunks ``r`` and ``2N-1-r`` of each.  Every layout
describes its tokens as *runs* (local start, first position, count) with one stride, from which
both the positions and the masked block plans (:mod:`striped_sp.plan.masks`) derive.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Sequence

import torch

__all__ = [
    "BlockCall",
    "Layout",
    "LAYOUTS",
    "get_layout",
    "positions",
    "shard",
    "unshard",
]


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
        increase along each run; a layout that places whole documents (:class:`Striped` with a
        ``doc_placement``) lists its runs out of global order."""
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


class Contiguous(Layout):
    name = "contiguous"

    def window_block(self, world_size, local_len, mask=None):
        return local_len

    def runs(self, seq_len, world_size, rank, cu_seqlens=None):
        n = seq_len // world_size
        return [(0, rank * n, n)]

    def causal_plan(self, rank, source, world_size, local_len):
        if source == rank:
            return [BlockCall(_ALL, _ALL, True)]
        if source < rank:
            return [BlockCall(_ALL, _ALL, False)]
        return []

    contiguous_slices = True  # see Layout.contiguous_slices


class Zigzag(Layout):
    name = "zigzag"
    seq_multiple = 2
    places_documents = True

    def document_multiple(self, world_size):
        return 2 * world_size  # Transformer Engine's THD rule: each document in 2N chunks

    def runs(self, seq_len, world_size, rank, cu_seqlens=None):
        return self._runs(seq_len, world_size, torch.tensor([rank]), cu_seqlens)[0]

    def all_run_tables(self, seq_len, world_size, cu_seqlens=None):
        runs = self._runs(seq_len, world_size, torch.arange(world_size), cu_seqlens)  # [N, 2 * docs, 3]
        steps = torch.ones(world_size, runs.size(1), 1, dtype=torch.int64)
        return torch.cat([runs, steps], 2).view(-1, 4), torch.full((world_size,), runs.size(1), dtype=torch.int64)

    @staticmethod
    def _runs(seq_len, world_size, ranks, cu_seqlens):
        """``[ranks, 2 * docs, 3]``: two runs per document (its chunks rank and 2N-1-rank), vectorised
        over documents and ranks: rows can pack thousands."""
        bounds = torch.tensor([0, seq_len] if cu_seqlens is None else list(cu_seqlens), dtype=torch.int64)
        start = bounds[:-1]
        c = (bounds[1:] - start) // (2 * world_size)
        local = (torch.cumsum(2 * c, 0) - 2 * c).expand(ranks.numel(), -1)
        r = ranks[:, None]
        first = torch.stack([local, start + r * c, c.expand_as(local)], 2)
        second = torch.stack([local + c, start + (2 * world_size - 1 - r) * c, c.expand_as(local)], 2)
        return torch.stack([first, second], 2).reshape(ranks.numel(), -1, 3)

    def causal_plan(self, rank, source, world_size, local_len):
        half = local_len // 2
        if source == rank:
            # Local indices are increasing positions, so the local causal mask is the global one.
            return [BlockCall(_ALL, _ALL, True)]
        if source < rank:
            # Both query chunks see the source's early chunk whole and none of its late chunk.
            return [BlockCall(_ALL, slice(0, half), False)]
        # source > rank: only the late query chunk sees anything, and it sees both key chunks.
        return [BlockCall(slice(half, None), _ALL, False)]


class Striped(Layout):
    """Rank ``r`` holds tokens ``r, r+N, r+2N, ...`` (``stripe_size=1``), or stripes of
    ``stripe_size`` tokens dealt round-robin: stripe ``g`` (tokens ``g*s .. g*s+s-1``) goes to rank
    ``g mod N``; ``stripe_size="doc"``: per document, ``2N`` stripes of about ``L / 2N`` tokens dealt
    in a round trip (ranks ``0 .. N-1``, then ``N-1 .. 0``; :mod:`striped_sp.plan.doc_stripes`), so that
    every ring block is a few large dense rectangles.  ``doc_placement`` (packed rows,
    :mod:`striped_sp.plan.placement`): ``"split"`` stripes every document over all ranks; ``"auto"`` or
    an int ``L`` keeps documents of at most ``L`` tokens (``"auto"``: a length the cost model picks)
    whole on one rank, dealt by a balancing solver, and stripes the rest.  ``stripe_size="auto"``:
    on each packed row, the stripe size and placement the cost model predicts fastest
    (:mod:`striped_sp.plan.search`; ``doc_placement`` then defaults to ``"auto"`` too); a row of one
    document runs token-by-token stripes.

    The default (``Striped()``, ``layout="striped"``: neither parameter given) is ``"auto"``: the
    search per packed batch, stripes of 1 on rows without documents (the dense plans, unchanged).
    Any parameter given pins it: ``stripe_size=1`` (key ``"striped:stripe=1"``) is the paper's
    layout on every row, and a ``doc_placement`` alone keeps stripes of 1 (``"striped:place=L"``).

    ``window`` / ``global_every`` (``"striped:window=W,global_every=K"``; ``"auto"`` stripes only): a
    hint that the model's layers have a sliding window of ``W`` tokens (one global causal layer in
    every ``K``), since the window is not known where the batch is sharded.  A row of one document
    then runs the stripes :func:`~striped_sp.plan.stripe_choice.choose_stripe_size` gives for it
    (``W / 4`` where the window layers hold enough of the entries, else 1), resolved per row length
    (:meth:`row_stripe`); packed rows run stripes of ``W / 8`` from
    :data:`~striped_sp.plan.stripe_choice.PACKED_WINDOW_MIN_RANKS` ranks on and the search on fewer
    (:meth:`packed_stripe`).  Every layer of the model runs those stripes:
    the global layers run the masked plans of them, the window layers skip the ring steps past the
    window (:meth:`window_block`)."""

    name = "striped"

    def __init__(self, stripe_size: int | str | None = None, doc_placement=None, window: int | None = None,
                 global_every: int | None = None):
        from .placement import check_placement, check_stripe_size
        from .stripe_choice import check_window_hint

        #: no parameter given: the default, the per-batch search (key "striped")
        self.default = stripe_size is None and doc_placement is None and window is None and global_every is None
        self.window, self.global_every = check_window_hint(window, global_every)
        given_stripe = stripe_size
        if stripe_size is None:  # a placement alone keeps token-by-token stripes (as before the default)
            stripe_size = "auto" if doc_placement is None else 1
        self.stripe_size = check_stripe_size(stripe_size)
        if doc_placement is None:
            doc_placement = "auto" if self.stripe_size == "auto" else "split"
        self.doc_placement = check_placement(doc_placement)
        self.placed = self.doc_placement != "split"
        self.per_document = self.stripe_size == "doc"
        # "auto": a packed row runs the plan plan/search.py finds fastest for it (any stripe size,
        # any placement); a row without documents runs token-by-token stripes
        self.auto = self.stripe_size == "auto"
        self.places_documents = self.placed or self.per_document or self.auto
        # whole documents (or per-document stripes) fill each rank up to S/N exactly, so only a
        # plain striped row needs S % (N*s) == 0
        self.seq_multiple = 1 if self.places_documents else self.stripe_size
        self.dense_plans = self.stripe_size in (1, "auto")
        self.strict_block = self.stripe_size in (1, "auto")
        if self.window is not None:
            if not self.auto:
                pinned = (f"stripe_size={given_stripe!r} pins the stripes it would choose" if given_stripe is not None
                          else f"doc_placement={self.doc_placement!r} without a stripe size keeps stripes of 1 "
                               "(add stripe=auto)")
                raise ValueError(f"layout parameter window={self.window} applies to stripe=auto (the default) only: "
                                 + pinned)
            self.dense_plans = False  # the row's stripes decide (dense_row)

    @property
    def key(self) -> str:
        if self.default:
            return self.name
        params = []
        if self.stripe_size != 1 or not self.placed:  # stripes of 1 pinned: "stripe=1"; placed: "place=L" says it
            params.append(f"stripe={self.stripe_size}")
        if self.placed != self.auto or (self.placed and self.doc_placement != "auto"):
            params.append(f"place={self.doc_placement}")  # "auto" stripes place "auto" unless told
        if self.window is not None:
            if params == ["stripe=auto"]:  # the default's search: "striped:window=W" says it
                params = []
            params.append(f"window={self.window}")
            if self.global_every is not None:
                params.append(f"global_every={self.global_every}")
        return self.name + (":" + ",".join(params) if params else "")

    def row_stripe(self, seq_len: int, world_size: int) -> int:
        """The stripe size a row of one document of ``seq_len`` tokens runs on ``world_size`` ranks:
        1, or with a window hint the one :func:`~striped_sp.plan.stripe_choice.choose_stripe_size`
        gives (a power of two dividing ``seq_len / world_size``; 1 where it would be under
        :data:`~striped_sp.plan.stripe_choice.MIN_STRIPE`)."""
        if not self.auto:
            return self.stripe_size
        if self.window is None:
            return 1
        from .stripe_choice import MIN_STRIPE, choose_stripe_size, window_layer_counts

        window_layers, global_layers = window_layer_counts(self.global_every)
        stripe = choose_stripe_size(int(seq_len), int(world_size), packed=False, window=self.window,
                                    window_layers=window_layers, global_layers=global_layers)
        return stripe if stripe >= MIN_STRIPE else 1  # a row whose S / N no stripe of 64+ divides

    def packed_stripe(self, seq_len: int, world_size: int) -> int | None:
        """With a window hint on ``world_size >= PACKED_WINDOW_MIN_RANKS`` ranks, the stripes a packed row
        of ``seq_len`` tokens runs: ``W / 8`` (the rule of
        :func:`~striped_sp.plan.stripe_choice.choose_stripe_size` for packed rows), halved until the
        row is a whole number of stripes per rank; ``None``: the per-batch search (fewer ranks, no
        hint, or no stripe of 64 or more fits)."""
        from .stripe_choice import MIN_STRIPE, PACKED_WINDOW_MIN_RANKS, choose_stripe_size, window_layer_counts

        if not self.auto or self.window is None or world_size < PACKED_WINDOW_MIN_RANKS:
            return None
        window_layers, global_layers = window_layer_counts(self.global_every)
        stripe = choose_stripe_size(int(seq_len), int(world_size), packed=True, window=self.window,
                                    window_layers=window_layers, global_layers=global_layers)
        while stripe >= MIN_STRIPE and seq_len % (world_size * stripe):
            stripe //= 2
        return stripe if stripe >= MIN_STRIPE else None

    def row_plan(self, seq_len: int, world_size: int, cu_seqlens=None) -> tuple:
        """``(stripe_size, doc_placement)`` a row runs: the layout's own, with ``"auto"`` resolved where
        it does not search: a row of one document (:meth:`row_stripe`), a packed row under a window
        hint on enough ranks (:meth:`packed_stripe`)."""
        if not self.auto:
            return self.stripe_size, self.doc_placement
        if cu_seqlens is None or len(cu_seqlens) <= 2:
            return self.row_stripe(seq_len, world_size), "split"
        stripe = self.packed_stripe(seq_len, world_size)
        return (self.stripe_size, self.doc_placement) if stripe is None else (stripe, "split")

    def dense_row(self, seq_len, world_size):
        return self.dense_plans or (self.window is not None and self.row_stripe(seq_len, world_size) == 1)

    def window_block(self, world_size, local_len, mask=None):
        if self.auto:  # the row's stripes (runs), or None under the search's plan
            stripe = self.row_plan(local_len * world_size, world_size, None if mask is None else mask.bounds)[0]
            return None if stripe == "auto" else stripe
        return None if self.placed or self.per_document else self.stripe_size

    def runs(self, seq_len, world_size, rank, cu_seqlens=None):
        stripe, placement = self.row_plan(seq_len, world_size, cu_seqlens)
        if stripe == 1 and (placement == "split" or cu_seqlens is None):
            return [(0, rank, seq_len // world_size)]
        from .search import placed_runs

        return placed_runs(_bounds(seq_len, cu_seqlens), world_size, stripe, placement)[rank]

    def stride(self, world_size):
        return world_size if self.stripe_size in (1, "auto") else 1

    def decision(self, seq_len, world_size, cu_seqlens=None):
        packed = None if cu_seqlens is None or len(cu_seqlens) <= 2 else self.packed_stripe(seq_len, world_size)
        if packed is not None:
            return (f"a packed row of {len(cu_seqlens) - 1} documents under the window hint {self.window} on "
                    f"{world_size} ranks: stripes of {packed} (W / 8; the per-batch search, which knows no windows, "
                    "measured up to 1.4x slower there from 4 ranks on)")
        if cu_seqlens is None or len(cu_seqlens) <= 2:
            if self.auto and self.window is not None:
                stripe = self.row_stripe(seq_len, world_size)
                every = "every layer" if self.global_every is None else f"one global layer in {self.global_every}"
                return (f"a row of one document under the window hint {self.window} ({every}): stripes of {stripe}"
                        + (" (the window rule of plan/stripe_choice.py: W / 4 where window layers hold at least "
                           "20% of the entries)" if stripe > 1 else
                           " (the window layers hold too few of the entries for larger stripes, or the row is too "
                           "short), the dense plans on layers without a window"))
            if self.auto:
                return ("a row of one document: stripes of 1, the dense plans (stripe_size='auto' searches "
                        "packed rows; on one document zigzag measured faster on the CPU kernel, docs/tuning.md)")
            return None
        from .search import decision

        return decision(_bounds(seq_len, cu_seqlens), world_size, self.stripe_size, self.doc_placement)

    def causal_plan(self, rank, source, world_size, local_len):
        if self.stripe_size not in (1, "auto") or not self.dense_row(local_len * world_size, world_size):
            raise NotImplementedError("striped with stripe_size > 1 (or a window hint's stripes > 1 on this row) "
                                      "runs the engine's masked plans")
        # Key b of `source` sits at b*N + source, query a of `rank` at a*N + rank.
        if source <= rank:
            return [BlockCall(_ALL, _ALL, True)]  # b <= a
        if local_len == 1:
            return []
        # b < a: the causal kernel on q[1:] against k[:-1] (never a mask: a fully masked row
        # would come back from fused kernels with lse = 0 instead of -inf).
        return [BlockCall(slice(1, None), slice(0, local_len - 1), True, strict=True)]

    def flattens_rows(self, local_len):
        # without document placement, and each row a whole number of stripes per rank: stripe g of
        # row i is stripe i * S / s + g of the flat row, on the same rank
        return not self.places_documents and local_len % self.stripe_size == 0


LAYOUTS: dict[str, Layout] = {cls.name: cls() for cls in (Striped, Zigzag, Contiguous)}
#: the adapters' algorithm names (``--context-parallel-algo``, the DeepSpeed section's ``algo``,
#: ``DistributedAttention(layout=)``) -> the layout they run: ``ring`` is ``contiguous``
ALGOS: dict[str, str] = {"striped": "striped", "zigzag": "zigzag", "ring": "contiguous"}


def _bounds(seq_len: int, cu_seqlens) -> tuple:
    """Document bounds as a tuple of ints (the placement cache's key); a tuple of ints as it is
    (a mask's bounds, asked for by every run table of a plan)."""
    if cu_seqlens is None:
        return (0, seq_len)
    if type(cu_seqlens) is tuple and all(type(b) is int for b in (cu_seqlens[0], cu_seqlens[-1])):
        return cu_seqlens
    return tuple(int(b) for b in cu_seqlens)


def _parse_params(text: str) -> dict:
    """``"stripe=128,place=auto"`` -> ``{"stripe_size": 128, "doc_placement": "auto"}``."""
    names = {"stripe": "stripe_size", "place": "doc_placement", "window": "window", "global_every": "global_every"}
    params = {}
    for item in filter(None, text.split(",")):
        key, sep, val = item.partition("=")
        if not sep or key.strip() not in names:
            raise ValueError(f"layout parameter {item!r}: expected stripe=<int>|doc|auto, place=split|auto|<int>, "
                             "window=<int> or global_every=<int>")
        val = val.strip()
        params[names[key.strip()]] = int(val) if re.fullmatch(r"-?[0-9]+", val) else val
    return params


def get_layout(layout: str | Layout, stripe_size: int | None = None, doc_placement=None) -> Layout:
    """The :class:`Layout` named ``layout`` (or ``layout`` itself); ``ValueError`` if unknown.

    A striped layout takes parameters, in the name (``"striped:stripe=128,place=auto"``, what
    :attr:`Layout.key` prints) or as arguments (``stripe_size``, ``doc_placement``; ``None``: keep
    the name's or the default)."""
    if isinstance(layout, Layout):
        if stripe_size is None and doc_placement is None:
            return layout
        base, params = layout, {}
        if isinstance(layout, Striped) and not layout.default:
            params = {"stripe_size": layout.stripe_size, "doc_placement": layout.doc_placement,
                      "window": layout.window, "global_every": layout.global_every}
    else:
        if not isinstance(layout, str):
            raise ValueError(f"unknown layout {layout!r}: expected one of {sorted(LAYOUTS)}")
        name, _, rest = layout.partition(":")
        if name not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}: expected one of {sorted(LAYOUTS)}")
        base, params = LAYOUTS[name], _parse_params(rest)
        if params and name != "striped":
            raise ValueError(f"layout {layout!r}: only 'striped' takes stripe / place / window parameters")
    given = {k: v for k, v in (("stripe_size", stripe_size), ("doc_placement", doc_placement)) if v is not None}
    if given and not isinstance(base, Striped):
        raise ValueError(f"stripe_size / doc_placement ({given}) apply to layout 'striped' only, not {base.name!r}")
    params.update(given)
    if not isinstance(base, Striped) or (not params and base.default):
        return base if not isinstance(base, Striped) else LAYOUTS["striped"]
    if not params:
        return base
    lay = Striped(**params)
    return LAYOUTS["striped"] if lay.key == LAYOUTS["striped"].key else lay


def _check_rank(world_size: int, rank: int) -> None:
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r} must be an int, got {type(value).__name__}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be >= 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must satisfy 0 <= rank < world_size={world_size}")


def positions(seq_len: int, world_size: int, rank: int, layout: str = "striped", cu_seqlens=None,
              stripe_size: int | None = None, doc_placement=None) -> torch.Tensor:
    """Global positions (int64) of the tokens that ``rank`` holds under ``layout``, in local order
    (increasing unless whole documents are placed).

    ``cu_seqlens``: document boundaries of a packed row (see :func:`striped_sp.ring_attention`);
    it changes ``zigzag`` (per-document chunks, every document a multiple of ``2N`` long) and a
    striped layout with ``doc_placement``.  ``stripe_size`` / ``doc_placement``: see
    :class:`Striped`."""
    from .masks import check_cu_seqlens

    lay = get_layout(layout, stripe_size, doc_placement)
    _check_rank(world_size, rank)
    bounds = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seq_len, world_size, lay)
    return lay.positions(seq_len, world_size, rank, bounds)


def _check_dim(what: str, name: str, x, dim) -> int:
    """``dim`` of tensor ``x`` as a non-negative index (``TypeError`` / ``ValueError`` naming both)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"{what}: dim={dim!r} is not a dim of {name} of shape {tuple(x.shape)}")
    return dim % x.dim()


def shard(x: torch.Tensor, world_size: int, rank: int, dim: int = 1, layout: str = "striped",
          cu_seqlens=None, stripe_size: int | None = None, doc_placement=None) -> torch.Tensor:
    """The part of ``x`` that ``rank`` holds: ``x.index_select(dim, positions(...))``.

    A packed row whose placement depends on its documents (the default ``striped``, ``zigzag``) must
    be sharded with its ``cu_seqlens``: this call notes that it was, and ``ring_attention(...,
    cu_seqlens=)`` refuses a row no such call sharded (:mod:`striped_sp.plan.sharded_rows`)."""
    dim = _check_dim("shard", "x", x, dim)
    lay = get_layout(layout, stripe_size, doc_placement)
    idx = positions(x.size(dim), world_size, rank, lay, cu_seqlens).to(x.device)
    if cu_seqlens is not None:
        from .sharded_rows import record_sharded

        record_sharded(lay, world_size, cu_seqlens)
    return x.index_select(dim, idx)


def unshard(shards: Sequence[torch.Tensor], dim: int = 1, layout: str = "striped", cu_seqlens=None,
            stripe_size: int | None = None, doc_placement=None) -> torch.Tensor:
    """The full tensor from every rank's shard, in rank order (the inverse of :func:`shard`)."""
    if isinstance(shards, torch.Tensor) or not isinstance(shards, Sequence):
        raise TypeError(f"unshard takes a list of every rank's shard (tensors), got {type(shards).__name__}")
    if len(shards) == 0:
        raise ValueError("unshard needs at least one shard, got an empty list")
    lay = get_layout(layout, stripe_size, doc_placement)
    world_size = len(shards)
    dim = _check_dim("unshard", "shard 0", shards[0], dim)
    local = shards[0].size(dim)
    for r, s in enumerate(shards):
        _check_dim("unshard", f"shard {r}", s, dim)
        if s.size(dim) != local:
            raise ValueError(
                f"shard {r} has {s.size(dim)} tokens on dim {dim}, shard 0 has {local}: all must be equal"
            )
        if s.shape != shards[0].shape or s.dtype != shards[0].dtype or s.device != shards[0].device:
            raise ValueError(f"shard {r} is {tuple(s.shape)} {s.dtype} on {s.device}, shard 0 is "
                             f"{tuple(shards[0].shape)} {shards[0].dtype} on {shards[0].device}: all must match")
    seq_len = local * world_size
    stacked = torch.cat(list(shards), dim=dim)
    order = torch.cat([positions(seq_len, world_size, r, lay, cu_seqlens) for r in range(world_size)])
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(seq_len, dtype=order.dtype)
    return stacked.index_select(dim, inverse.to(stacked.device))
