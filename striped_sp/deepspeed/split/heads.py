"""What every split mixer shares: which heads (and the groups they read) each rank owns, the
per-rank send buffer, the convolution rows of a rank's channels, and the mixer's kernels.

A split mixer runs its per-token input projections on this rank's tokens, packs for every rank
``j`` the channels rank ``j`` owns (:func:`pack`), trades the sequence split for that channel split
with one all-to-all (:func:`striped_sp.engine.head_split.tokens_to_heads`), runs the convolution
and the scan on all ``S`` tokens in natural order with the model's own kernels on its channels only,
and trades back (:func:`~striped_sp.engine.head_split.heads_to_tokens`) before the layers that mix
heads (the gated norm over all channels, the output projection)."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys

import torch

__all__ = ["HeadGroups", "head_groups", "pack", "unpack", "conv_rows", "kernels_of", "source_has"]


@dataclasses.dataclass(frozen=True)
class HeadGroups:
    """The heads of a mixer dealt over ``n`` ranks: rank ``j`` owns the ``heads // n`` consecutive
    heads ``heads_of[j]`` and reads the groups ``groups_of[j]`` (a gated delta net's key heads, Mamba2's
    B/C groups); a group read by several ranks is sent to each of them (its gradient sums back)."""

    heads_of: tuple[tuple[int, ...], ...]
    groups_of: tuple[tuple[int, ...], ...]

    @property
    def local_heads(self) -> int:
        return len(self.heads_of[0])

    @property
    def local_groups(self) -> int:
        return len(self.groups_of[0])

    def group_index(self, device=None) -> torch.Tensor:
        """``[n * local_groups]`` (int64): the groups of rank 0, then rank 1's, ... (made once per device)"""
        return _index_on(tuple(g for gs in self.groups_of for g in gs), str(torch.device(device or "cpu")))


@functools.lru_cache(maxsize=256)
def head_groups(n: int, heads: int, groups: int, what: str = "heads") -> HeadGroups | str:
    """The deal of ``heads`` (head ``h`` reading group ``h // (heads // groups)``) over ``n`` ranks,
    or the reason it cannot split (a string naming the numbers): heads not divisible by ``n``, or
    ranks whose heads read different numbers of groups, or a local head -> group map that the kernels'
    ``local head // (local heads / local groups)`` rule would get wrong."""
    if heads % n:
        return f"{heads} {what} are not divisible by {n} ranks"
    if groups < 1 or heads % groups:
        return f"{heads} {what} do not split into {groups} groups"
    per_group, local = heads // groups, heads // n
    heads_of = tuple(tuple(range(j * local, (j + 1) * local)) for j in range(n))
    groups_of = tuple(tuple(sorted({h // per_group for h in hs})) for hs in heads_of)
    counts = {len(gs) for gs in groups_of}
    if len(counts) != 1 or local % len(groups_of[0]):
        return f"{heads} {what} in {groups} groups do not deal evenly over {n} ranks"
    ratio = local // len(groups_of[0])
    for hs, gs in zip(heads_of, groups_of):
        if any(gs[i // ratio] != h // per_group for i, h in enumerate(hs)):
            return f"{heads} {what} in {groups} groups do not deal evenly over {n} ranks"
    return HeadGroups(heads_of, groups_of)


def pack(parts: list[torch.Tensor], n: int) -> tuple[torch.Tensor, list[int]]:
    """``parts``: tensors ``[b, s, n, c_i]`` (``[:, :, j]``: what rank ``j`` gets) -> ``[b, s, n, sum c_i]``
    and the ``c_i`` (for :func:`unpack`)."""
    sizes = [p.size(-1) for p in parts]
    return torch.cat(parts, dim=-1), sizes


def unpack(x: torch.Tensor, sizes: list[int]) -> tuple[torch.Tensor, ...]:
    """The inverse of :func:`pack` on the last dim of ``x``."""
    return torch.split(x, sizes, dim=-1)


def per_rank(x: torch.Tensor, n: int, index: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``[b, s, heads, d]`` -> ``[b, s, n, heads_per_rank * d]``: consecutive heads per rank, or the
    heads ``index`` (``[n * k]``, rank after rank, repeats allowed) when given."""
    if index is not None:
        x = x.index_select(2, index)
    b, s = x.shape[:2]
    return x.reshape(b, s, n, -1)


def conv_rows(sections: list[tuple[int, int, tuple[int, ...]]], device=None) -> torch.Tensor:
    """The rows of a depthwise convolution's weight that a rank's channels use: ``sections`` lists
    ``(offset, width, units)`` per range of the conv's channels (unit ``u`` of that range is rows
    ``offset + u * width ... + width - 1``).  ``[rows]`` int64."""
    rows = tuple(offset + u * width + i for offset, width, units in sections for u in units for i in range(width))
    return _index_on(rows, str(torch.device(device or "cpu")))


@functools.lru_cache(maxsize=512)
def _index_on(values: tuple, device: str) -> torch.Tensor:
    """``values`` as an int64 tensor on ``device``, made (and copied to the device) once: a layer's
    later calls reuse it, with no host-to-device copy per layer."""
    return torch.tensor(values, dtype=torch.long, device=device)


def kernels_of(module: torch.nn.Module, *names: str):
    """The functions ``names`` of the module file that defines ``type(module)`` (the model's own
    kernels, with transformers' hub / installed-package dispatch), or ``None`` if one is missing."""
    found = [getattr(sys.modules.get(type(module).__module__), name, None) for name in names]
    return None if any(f is None for f in found) else found


@functools.lru_cache(maxsize=None)
def _forward_source(cls: type) -> str:
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def source_has(module: torch.nn.Module, *markers: str) -> bool:
    """Whether the forward of ``type(module)`` contains every marker (the form a split mixer rewrites)."""
    source = _forward_source(type(module))
    return all(m in source for m in markers)
