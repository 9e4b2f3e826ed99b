"""The ring: neighbours from an explicit process group and double-buffered KV transfers."""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["Ring", "Transfer"]


class Transfer:
    """Receives in flight from the previous rank; :meth:`wait` returns the received tensors."""

    def __init__(self, requests, sent: list[torch.Tensor], received: list[torch.Tensor]):
        self._requests = requests
        self._sent = sent  # kept alive until the sends complete
        self._received = received

    def wait(self) -> list[torch.Tensor]:
        for req in self._requests:
            req.wait()
        self._sent = []
        return self._received


class Ring:
    """A ring over the ranks of ``group``: sends go to the next rank, receives come from the
    previous one.  Neighbours are *global* ranks, taken from the group itself.  ``None``: a ring
    of this rank alone (it never sends)."""

    def __init__(self, group: dist.ProcessGroup | None):
        self.group = group
        if group is None:  # a ring of one rank (hierarchical CP with every rank in one Ulysses group)
            self.rank, self.world_size = 0, 1
            return
        ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank(group)
        self.world_size = len(ranks)
        self.next_rank = ranks[(self.rank + 1) % self.world_size]
        self.prev_rank = ranks[(self.rank - 1) % self.world_size]

    def shift(self, tensors: list[torch.Tensor]) -> Transfer:
        """Post the send of ``tensors`` to the next rank and receives of same-shaped tensors from
        the previous one into fresh buffers (the double buffer); returns at once."""
        sent = [t.contiguous() for t in tensors]
        received = [torch.empty_like(t) for t in sent]
        ops = [dist.P2POp(dist.isend, t, self.next_rank, self.group) for t in sent]
        ops += [dist.P2POp(dist.irecv, r, self.prev_rank, self.group) for r in received]
        return Transfer(dist.batch_isend_irecv(ops), sent, received)
