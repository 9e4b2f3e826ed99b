"""The ``striped`` layout (Striped Attention, arXiv 2311.09431) and its parameters: stripe size
(tokens, ``"doc"`` per document, ``"auto"`` the per-batch search), whole-document placement and the
window hint; :class:`Striped` resolves what each row runs (:meth:`Striped.row_plan`).
"""

from __future__ import annotations

from .chunk_layouts import Zigzag
from .layout_base import _ALL, BlockCall, Layout

__all__ = ["Striped"]


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
    then runs the placement the cost model predicts fastest for those layers
    (:func:`~striped_sp.plan.window_choice.window_choice`: zigzag's order, stripes of 1 or of a power
    of two up to ``S / N``), resolved per row length (:meth:`row_stripe`); packed rows run stripes of ``W / 8`` from
    :data:`~striped_sp.plan.stripe_choice.PACKED_WINDOW_MIN_RANKS` ranks on and the search on fewer
    (:meth:`packed_stripe`).  Every layer of the model runs those stripes:
    the global layers run the masked plans of them, the window layers skip the ring steps past the
    window (:meth:`window_block`)."""

    name = "striped"

    def __init__(self, stripe_size: int | str | None = None, doc_placement=None, window: int | None = None,
                 global_every: int | None = None, order: str | None = None):
        from .mirror import check_order
        from .placement import check_placement, check_stripe_size
        from .stripe_choice import check_window_hint

        #: no parameter given: the default, the per-batch search (key "striped")
        self.default = (stripe_size is None and doc_placement is None and window is None and global_every is None
                        and order is None)
        self.window, self.global_every = check_window_hint(window, global_every)
        #: how an int stripe size's stripes are dealt: "round" (g to rank g mod N) or "mirror"
        #: (zigzag's order, :mod:`striped_sp.plan.mirror`)
        self.order = check_order("round" if order is None else order)
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
        self.mirror = self.order == "mirror"
        if self.mirror and not isinstance(self.stripe_size, int):
            raise ValueError(f"layout parameter order='mirror' needs an int stripe size, got stripe_size="
                             f"{self.stripe_size!r} ('doc' stripes every document in zigzag's mirrored order already; "
                             "the default 'auto' tries both orders itself)")
        self.dense_plans = self.stripe_size in (1, "auto") and not self.mirror
        self.strict_block = self.dense_plans
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
        if self.mirror:
            params.append("order=mirror")
        if self.window is not None:
            if params == ["stripe=auto"]:  # the default's search: "striped:window=W" says it
                params = []
            params.append(f"window={self.window}")
            if self.global_every is not None:
                params.append(f"global_every={self.global_every}")
        return self.name + (":" + ",".join(params) if params else "")

    def row_stripe(self, seq_len: int, world_size: int) -> int | str:
        """The stripe size a row of one document of ``seq_len`` tokens runs on ``world_size`` ranks:
        1 or ``"doc"`` (zigzag's order), whichever the cost model predicts faster
        (:func:`~striped_sp.plan.dense_choice.dense_choice`); with a window hint the placement it
        predicts fastest for the hint's layers (:func:`~striped_sp.plan.window_choice.window_choice`:
        zigzag's order, stripes of 1 or a power of two dividing ``seq_len / world_size``)."""
        if not self.auto:
            return self.stripe_size
        if self.window is None:  # stripes of 1 or zigzag's order ("doc"), whichever the cost model says
            from .dense_choice import dense_choice

            return dense_choice(int(seq_len), int(world_size))[0]
        from .stripe_choice import window_layer_counts
        from .window_choice import window_choice

        return window_choice(int(seq_len), int(world_size), self.window, *window_layer_counts(self.global_every),
                             striped=Striped)[0]

    def packed_stripe(self, seq_len: int, world_size: int) -> int | None:
        """With a window hint on ``world_size >= PACKED_WINDOW_MIN_RANKS`` ranks, the stripes a packed row
        of ``seq_len`` tokens runs: ``W / 8`` (the rule of
        :func:`~striped_sp.plan.stripe_choice.choose_stripe_size` for packed rows), halved until the
        row is a whole number of stripes per rank, or the larger stripes the cost model picks for a row
        of one document of that length (:func:`~striped_sp.plan.window_choice.window_choice`; per row
        length, not per batch); ``None``: the per-batch search (fewer ranks, no hint, or no stripe of 64
        or more fits)."""
        from .stripe_choice import MIN_STRIPE, PACKED_WINDOW_MIN_RANKS, choose_stripe_size, window_layer_counts

        if not self.auto or self.window is None or world_size < PACKED_WINDOW_MIN_RANKS:
            return None
        window_layers, global_layers = window_layer_counts(self.global_every)
        stripe = choose_stripe_size(int(seq_len), int(world_size), packed=True, window=self.window,
                                    window_layers=window_layers, global_layers=global_layers)
        while stripe >= MIN_STRIPE and seq_len % (world_size * stripe):
            stripe //= 2
        if stripe < MIN_STRIPE:
            return None
        from .window_choice import window_choice

        # larger stripes where the cost model picks them for a row of one document of this length
        # (up to S / N: a window balances contiguous chunks; measured 1.3x W / 8 on the web mix at N = 4)
        larger = window_choice(int(seq_len), int(world_size), self.window, window_layers, global_layers,
                               striped=Striped)[0]
        return larger if isinstance(larger, int) and larger > stripe else stripe

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

    def zigzag_row(self, seq_len: int, world_size: int) -> bool:
        """Whether a row of one document runs zigzag's placement (``2N`` stripes of ``S / 2N`` dealt
        mirrored: per-document stripes on a row that splits evenly), and so zigzag's dense block plans."""
        return (world_size > 1 and seq_len % (2 * world_size) == 0
                and (self.per_document or (self.mirror and self.stripe_size * 2 * world_size == seq_len)
                     or (self.auto and self.row_stripe(seq_len, world_size) == "doc")))

    def dense_row(self, seq_len, world_size):
        if self.zigzag_row(seq_len, world_size):
            return True
        return self.dense_plans or (self.window is not None and self.row_stripe(seq_len, world_size) == 1)

    def window_block(self, world_size, local_len, mask=None):
        if self.auto:  # the row's stripes (runs), or None under the search's plan
            stripe = self.row_plan(local_len * world_size, world_size, None if mask is None else mask.bounds)[0]
            return None if isinstance(stripe, str) else stripe
        return None if self.placed or self.per_document or self.mirror else self.stripe_size

    def runs(self, seq_len, world_size, rank, cu_seqlens=None):
        stripe, placement = self.row_plan(seq_len, world_size, cu_seqlens)
        if stripe == 1 and (placement == "split" or cu_seqlens is None) and not self.mirror:
            return [(0, rank, seq_len // world_size)]
        from .search import placed_runs

        return placed_runs(_bounds(seq_len, cu_seqlens), world_size, stripe, placement, order=self.order)[rank]

    def stride(self, world_size):
        return world_size if self.stripe_size in (1, "auto") else 1

    def decision(self, seq_len, world_size, cu_seqlens=None):
        packed = None if cu_seqlens is None or len(cu_seqlens) <= 2 else self.packed_stripe(seq_len, world_size)
        if packed is not None:
            return (f"a packed row of {len(cu_seqlens) - 1} documents under the window hint {self.window} on "
                    f"{world_size} ranks: stripes of {packed} (W / 8, or larger where the cost model picks larger for a "
                    "row of one document of this length; the per-batch search, which knows no windows, measured up "
                    "to 1.4x slower there from 4 ranks on)")
        if cu_seqlens is None or len(cu_seqlens) <= 2:
            if self.auto and self.window is not None:
                from .window_choice import window_decision

                return window_decision(int(seq_len), int(world_size), self.window, self.global_every, striped=Striped)
            if self.auto:
                from .dense_choice import dense_decision

                return dense_decision(int(seq_len), int(world_size))
            return None
        from .search import decision

        return decision(_bounds(seq_len, cu_seqlens), world_size, self.stripe_size, self.doc_placement,
                        order=self.order)

    def causal_plan(self, rank, source, world_size, local_len):
        if self.zigzag_row(local_len * world_size, world_size):  # zigzag's placement: its block plans
            return Zigzag.causal_plan(self, rank, source, world_size, local_len)
        if self.stripe_size not in (1, "auto") or self.mirror or not self.dense_row(local_len * world_size, world_size):
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
        return not self.places_documents and not self.mirror and local_len % self.stripe_size == 0


def _bounds(seq_len: int, cu_seqlens) -> tuple:
    """Document bounds as a tuple of ints (the placement cache's key); a tuple of ints as it is
    (a mask's bounds, asked for by every run table of a plan)."""
    if cu_seqlens is None:
        return (0, seq_len)
    if type(cu_seqlens) is tuple and all(type(b) is int for b in (cu_seqlens[0], cu_seqlens[-1])):
        return cu_seqlens
    return tuple(int(b) for b in cu_seqlens)
