"""``bench train``: the rows (workloads) and the runner interface the two model paths share.

A :class:`TrainRow` is one line of the table: dense rows of one length, packed web-mix rows
(documents drawn by :func:`striped_sp.bench.docs.packed_row`, a new row of the stream each round),
or a window model.  Its ``rounds`` are the full (unsharded) batches, the same on every rank and for
every layout: ``rounds[0]`` warms up, the others are timed.  A :class:`Runner` holds one layout's
model, optimizer and sharded batches; ``step(i)`` is one training step (forward, backward, gradient
reduction, optimizer step) on ``rounds[i]``.
"""

from __future__ import annotations

import dataclasses

import torch

from .docs import packed_row, parse_docs

__all__ = ["TrainRow", "Runner", "RunnerSkip", "make_row"]


class RunnerSkip(Exception):
    """This layout or peer cannot run here; the message says why."""


@dataclasses.dataclass
class TrainRow:
    model: str  # "megatron" or "hf"
    kind: str  # "dense", "packed" or "window"
    seq_len: int
    window: int = 0  # the window row: keys before a query (0: none)
    docs: str | None = None  # the packed row's document mix
    rounds: list = dataclasses.field(default_factory=list, repr=False)  # [(tokens [b, S], bounds | None)]

    @property
    def label(self) -> str:
        extra = {"dense": "", "packed": f" ({self.docs})", "window": f" (window {self.window})"}[self.kind]
        return f"{self.kind}{extra}"

    @property
    def documents(self) -> float | None:
        """Mean documents per packed row over the timed rounds."""
        rows = [b for _, b in self.rounds[1:] if b is not None]
        return sum(len(b) - 1 for b in rows) / len(rows) if rows else None


def make_row(model: str, kind: str, seq_len: int, rounds: int, batch: int, vocab: int, seed: int,
             window: int = 0, docs: str | None = None) -> TrainRow:
    """The row with ``rounds`` batches of seeded random tokens (packed rows: batch 1, row ``i`` of
    the packed stream of ``docs``)."""
    row = TrainRow(model, kind, seq_len, window if kind == "window" else 0, docs if kind == "packed" else None)
    mix = parse_docs(docs) if kind == "packed" else None
    for i in range(rounds):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + seq_len * 31 + i)
        tokens = torch.randint(0, vocab, (1 if mix else batch, seq_len), generator=gen)
        row.rounds.append((tokens, packed_row(mix, seq_len, row=i, seed=seed) if mix else None))
    return row


class Runner:
    """One column of the table on one row: ``activate()`` switches the process-wide settings its
    framework keeps (Megatron's installed algo, the HF attention's layout) before its steps;
    ``step(i)`` returns the detached loss of ``rounds[i]`` (this rank's share of the global mean)."""

    def __init__(self, name: str, layout: str | None):
        self.name, self.layout = name, layout
        self.param_bytes = 0

    def activate(self) -> None:
        pass

    def step(self, i: int) -> torch.Tensor:  # pragma: no cover - interface
        raise NotImplementedError
