"""The ring: neighbours from an explicit process group and double-buffered KV transfers."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Ring", "Transfer"]


class Transfer:
    """Receives in flight from the previous rank; :meth:`wait` returns the received tensors."""

    def __init__(self, requests, received: list[torch.Tensor]):
        self._requests = requests
        self._received = received

    def wait(self) -> list[torch.Tensor]:
        for req in self._requests:
            req.wait()
        return self._received


class Ring:
    """A ring over the ranks of ``group``: sends go to the next rank, receives come from the
    previous one.  Neighbours are *global* ranks, taken from the group itself."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.world_size = len(ranks)
        self.next_rank = ranks[(self.rank + 1) % self.world_size]
        self.prev_rank = ranks[(self.rank - 1) % self.world_size]

    def shift(self, tensors: list[torch.Tensor]) -> Transfer:
        """Post the send of ``tensors`` to the next rank and receives of same-shaped tensors from
        the previous one into fresh buffers (the double buffer); returns at once."""
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next_rank, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, self.prev_rank, self.group) for r in received]
        return Transfer(dist.batch_isend_irecv(ops), received)
