"""Data path: shift labels on the full sequence, then shard every sequence tensor by the layout.

Every rank of a sequence-parallel group loads the *same* full micro-batch (as Megatron does); each
keeps its own tokens.  Labels are shifted before sharding, so the target of every token travels
with that token and none is lost at shard edges.  No communication happens here.

A batch is a dict of ``[batch, seq, ...]`` tensors (``input_ids`` required).  The sharded batch has:

* ``input_ids`` and every other tensor whose dim 1 is the sequence: the local tokens;
* ``position_ids``: the global positions of the local tokens (from the batch if it has them, else
  ``0..S-1``), so RoPE sees the true positions;
* ``shift_labels``: the local tokens' targets (``labels`` shifted left by one on the full sequence,
  ``ignore_index`` after the last token); ``labels`` holds the same tensor, so that Hugging Face
  models compute their loss (their loss uses ``shift_labels`` as given and does not shift again);
* ``num_items_in_batch``: the number of targets that count in the *whole* micro-batch, so a
  rank's summed local loss divided by it is its exact share of the global mean loss.

``attention_mask`` may only mark every token valid (it is then dropped): the ring attends
causally over the whole sequence; mask padding out of the loss with ``ignore_index`` labels.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from ..layouts import get_layout, positions

__all__ = ["shard_batch", "ShardedDataLoader", "IGNORE_INDEX"]

IGNORE_INDEX = -100


def _shift_left(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    pad = torch.full_like(labels[:, :1], ignore_index)
    return torch.cat([labels[:, 1:], pad], dim=1)


def _check_batch(batch: Mapping[str, Any], world_size: int, layout: str) -> int:
    if not isinstance(batch, Mapping):
        raise ValueError(f"a batch must be a dict of tensors, got {type(batch).__name__}")
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("a batch needs 'input_ids', a [batch, seq] tensor")
    seq_len = ids.size(1)
    try:
        get_layout(layout).check_seq_len(seq_len, world_size)
    except ValueError as err:
        raise ValueError(f"batch['input_ids'] has {seq_len} tokens: {err}") from None
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and key in ("labels", "shift_labels", "position_ids", "attention_mask"):
            if value.dim() < 2 or value.size(1) != seq_len:
                raise ValueError(
                    f"batch[{key!r}] has shape {tuple(value.shape)}: dim 1 must be the sequence "
                    f"({seq_len} tokens, as input_ids)"
                )
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
        raise ValueError(
            "batch['attention_mask'] has padding (zeros): context parallelism attends causally over "
            "the whole sequence; pack or pad the data and put ignore_index in the labels instead"
        )
    return seq_len


def shard_batch(
    batch: Mapping[str, Any],
    world_size: int,
    rank: int,
    layout: str = "striped",
    ignore_index: int = IGNORE_INDEX,
) -> dict:
    """This rank's part of a full-sequence ``batch`` (see the module notes for the keys).

    If the batch already has ``shift_labels`` they are taken as the shifted targets; else
    ``labels`` are shifted here.  Raises ``ValueError`` when the sequence length does not fit the
    layout, when a sequence tensor has another length, or on an attention mask with padding.
    """
    seq_len = _check_batch(batch, world_size, layout)
    out = {k: v for k, v in batch.items() if k != "attention_mask"}
    ids = batch["input_ids"]
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(seq_len, device=ids.device).unsqueeze(0).expand_as(ids)
    if "shift_labels" in out:
        shifted = out["shift_labels"]
    elif "labels" in out:
        shifted = _shift_left(out["labels"], ignore_index)
    else:
        shifted = None
    if shifted is not None:
        out["shift_labels"] = shifted
        out["num_items_in_batch"] = (shifted != ignore_index).sum()
    idx = positions(seq_len, world_size, rank, layout).to(ids.device)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.size(1) == seq_len:
            out[key] = value.index_select(1, idx)
    if shifted is not None:
        out["labels"] = out["shift_labels"]
    return out


class ShardedDataLoader:
    """Wraps a loader of full-sequence batches; yields this rank's :func:`shard_batch` of each.

    ``group``: the sequence-parallel group (``None``: one rank, which still gets shifted labels and
    ``num_items_in_batch``).  Every rank of the group must see the same batches.
    """

    def __init__(self, loader: Iterable, group=None, layout: str = "striped", ignore_index: int = IGNORE_INDEX):
        import torch.distributed as dist

        get_layout(layout)
        self.loader = loader
        self.layout = layout
        self.ignore_index = ignore_index
        self.world_size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield shard_batch(batch, self.world_size, self.rank, self.layout, self.ignore_index)

    def __getattr__(self, name):  # sampler, dataset, batch_size, ... of the wrapped loader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)
