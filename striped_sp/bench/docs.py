"""Document-length mixes for the benchmark, packed into rows, and each layout's mask of a row.

``--docs SPEC``:

* ``lognormal:median=1024,sigma=1.2``: document lengths ``round(exp(N(log median, sigma)))``,
  at least 1 (a web-like mix: many short documents, a long tail);
* ``long``: the same mix, plus a few long documents: every document is, with probability 2%,
  drawn log-uniformly from 32k-128k tokens instead;
* ``fixed:L``: every document ``L`` tokens.

Documents are drawn with a seeded generator and concatenated; the stream is cut into rows of the
row length (a document that crosses a row end continues in the next row, as Megatron's GPT dataset
concatenates documents).  ``striped`` and ``contiguous`` shard the row as it is; ``zigzag`` pads
every document to a multiple of ``2N`` first (Transformer Engine's rule), so its row is longer by
``padding_tokens``.
"""

from __future__ import annotations

import dataclasses
import math
import random

from ..plan.layouts import get_layout
from ..plan.masks import MaskSpec, make_mask
from ..plan.packing import pad_documents

__all__ = ["DocMix", "parse_docs", "packed_row", "Workload", "workload", "visible_entries"]

LONG_PROB = 0.02
LONG_RANGE = (32 * 1024, 128 * 1024)


@dataclasses.dataclass(frozen=True)
class DocMix:
    kind: str  # "lognormal", "long" or "fixed"
    median: float = 1024.0
    sigma: float = 1.2
    length: int = 0
    spec: str = ""

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.length
        if self.kind == "long" and rng.random() < LONG_PROB:
            lo, hi = LONG_RANGE
            return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))
        return max(1, int(round(math.exp(rng.gauss(math.log(self.median), self.sigma)))))


def parse_docs(spec: str) -> DocMix:
    """The :class:`DocMix` of ``spec``; ``ValueError`` naming the spec when it is malformed."""
    text = spec.strip()
    if text == "long":
        return DocMix("long", spec=text)
    kind, _, rest = text.partition(":")
    if kind == "fixed":
        try:
            length = int(rest)
        except ValueError:
            length = 0
        if length < 1:
            raise ValueError(f"--docs {spec!r}: fixed:L needs a positive integer L")
        return DocMix("fixed", length=length, spec=text)
    if kind == "lognormal":
        params = {"median": 1024.0, "sigma": 1.2}
        for item in filter(None, rest.split(",")):
            key, _, val = item.partition("=")
            if key not in params:
                raise ValueError(f"--docs {spec!r}: unknown parameter {key!r} (expected median, sigma)")
            try:
                params[key] = float(val)
            except ValueError:
                raise ValueError(f"--docs {spec!r}: {key}={val!r} is not a number") from None
        if params["median"] <= 0 or params["sigma"] < 0:
            raise ValueError(f"--docs {spec!r}: median must be > 0 and sigma >= 0")
        return DocMix("lognormal", params["median"], params["sigma"], spec=text)
    raise ValueError(f"--docs {spec!r}: expected lognormal:median=M,sigma=S, long or fixed:L")


def packed_row(mix: DocMix, row_len: int, row: int = 0, seed: int = 0) -> list[int]:
    """``cu_seqlens`` of row ``row`` of the packed stream (seeded, so every run sees the same rows)."""
    rng = random.Random(seed)
    start, end = row * row_len, (row + 1) * row_len
    bounds, pos = [0], 0
    while pos < end:
        nxt = pos + mix.draw(rng)
        if nxt > start:
            bounds.append(min(nxt, end) - start)
        pos = nxt
    return bounds


def visible_entries(spec: MaskSpec) -> int:
    """Visible score entries of a causal packed row under ``spec`` (closed form per document)."""
    w = spec.left
    total = 0
    for a, b in zip(spec.bounds[:-1], spec.bounds[1:]):
        n = b - a
        if w < 0 or w >= n - 1:
            total += n * (n + 1) // 2
        else:
            total += (w + 1) * (w + 2) // 2 + (n - 1 - w) * (w + 1)
    return total


@dataclasses.dataclass(frozen=True)
class Workload:
    """One layout's view of a packed row: its mask (on its own, possibly padded, row)."""

    layout: str
    world_size: int
    mask: MaskSpec
    padding_tokens: int
    ideal_entries: float  # visible entries of the unpadded row / N

    @property
    def local_len(self) -> int:
        return self.mask.seq_len // self.world_size


def workload(layout: str, world_size: int, tokens_per_rank: int, docs: str | None, window: int | None,
             seed: int = 0) -> Workload:
    """The mask of one packed row of ``world_size * tokens_per_rank`` tokens for ``layout``."""
    seq = world_size * tokens_per_rank
    bounds = [0, seq] if docs is None else packed_row(parse_docs(docs), seq, seed=seed)
    win = (window, 0) if window else None  # --window W: the left window, window_size=(W, 0)
    unpadded = make_mask(seq, world_size, get_layout("striped"), bounds, win, True)
    ideal = visible_entries(unpadded) / world_size
    pad = 0
    if layout == "zigzag" and docs is not None:
        padded = pad_documents(bounds, world_size, "zigzag")
        bounds, pad = padded.cu_seqlens.tolist(), padded.padding_tokens
    mask = make_mask(bounds[-1], world_size, get_layout(layout), bounds, win, True)
    return Workload(layout, world_size, mask, pad, ideal)
