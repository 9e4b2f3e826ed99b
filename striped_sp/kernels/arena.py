"""The index tensors of a plan's programs, put on the device together (:class:`Arena`)."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["Arena", "Slot"]


class Arena:
    """The index tensors of one plan, placed on a device together: :meth:`add` collects CPU
    tensors, :meth:`place` moves them all with one copy (pinned and non-blocking on CUDA) and
    fills in each :class:`Slot`; on the CPU they stay where they are."""

    def __init__(self):
        self.slots: list[Slot] = []
        self.views: list = []  # (slot, parent, start, length): slots that view another's tensor
        self.staging = None  # the pinned buffer, alive until the copy has run
        self.copies = 0

    def add(self, t: torch.Tensor | None) -> "Slot | None":
        if t is None:
            return None
        slot = Slot(t.contiguous())
        self.slots.append(slot)
        return slot

    def view(self, parent: "Slot", start: int, length: int) -> "Slot":
        """A slot for ``parent``'s elements ``start .. start + length - 1`` (of a 1-D tensor):
        a view, on the device once placed (no copy of its own)."""
        slot = Slot(parent.t[start:start + length])
        self.views.append((slot, parent, start, length))
        return slot

    def place(self, device: torch.device, force: bool = False) -> None:
        """``force``: pack and copy on the CPU too (the device path's packing, for tests)."""
        device = torch.device(device)
        if (device.type == "cpu" and not force) or not self.slots:
            return
        offsets, total = [], 0
        for slot in self.slots:
            offsets.append(total)
            total += -(-slot.t.numel() * slot.t.element_size() // 8) * 8  # 8-byte aligned views
        buf = torch.empty(total, dtype=torch.uint8)
        for slot, off in zip(self.slots, offsets):
            nbytes = slot.t.numel() * slot.t.element_size()
            buf[off:off + nbytes] = slot.t.reshape(-1).view(torch.uint8)
        if device.type == "cuda":
            buf = buf.pin_memory()
            self.staging = buf
        placed = buf.to(device, non_blocking=True)
        self.copies += 1
        for slot, off in zip(self.slots, offsets):
            t = slot.t
            slot.t = placed[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        for slot, parent, start, length in self.views:
            slot.t = parent.t[start:start + length]


@dataclasses.dataclass
class Slot:
    """One tensor of an :class:`Arena`: a CPU tensor until placed, then its device view."""

    t: torch.Tensor
