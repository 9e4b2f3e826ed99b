"""Varlen calls (many band segments at once) on kernels that have no varlen entry point.

A :class:`~striped_sp.masks.Segments` call is covered with few fused calls:

* *direct*: a large segment that is a full rectangle or a square causal triangle is one plain
  kernel call on its slices (the kernel skips masked tiles of the triangle itself);
* *packed*: every other segment (short documents, bands of a sliding window, cut into tiles of
  at most ``TILE`` query rows) goes into packs, several consecutive segments per pack, and all
  packs of one size class run as a single batched kernel call with a block-diagonal band mask.

Pack rows no segment owns see one padding key, so no row is fully masked inside the kernel; their
results are dropped.  Shapes follow the kernel interface: ``q`` ``[b, Lq, h, d]`` and ``k``/``v``
``[b, Lk, kv_heads, d]`` packed as the segments say, ``lse`` float32 ``[b, h, Lq]``.
"""

from __future__ import annotations

import dataclasses

import torch

from .masks import Segments

__all__ = ["TILE", "varlen_forward", "varlen_backward"]

#: query rows per tile of a long band (and the largest pack class)
TILE = 128
#: smallest pack class (query rows)
MIN_CLASS = 8
#: a full or causal segment with at least this many score entries is called directly
DIRECT_ENTRIES = TILE * TILE
#: items of one shape and band, at least this many and this tall, share one broadcast mask
UNIFORM_COUNT, UNIFORM_ROWS = 4, 32


@dataclasses.dataclass
class _Pack:
    """One size class of packs: gather indices into ``[.., L + 1]`` (row ``L`` is padding) and the mask."""

    q_index: torch.Tensor  # [P * Cq] int64
    k_index: torch.Tensor  # [P * Ck] int64
    mask: torch.Tensor  # [P, 1, Cq, Ck] bool, or [1, 1, Cq, Ck] shared by every pack
    packs: int
    cq: int
    ck: int


@dataclasses.dataclass
class _Schedule:
    direct: list  # (q0, q1, k0, k1, causal)
    packs: list  # [_Pack]


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def _expand(lengths: torch.Tensor):
    """(item id, offset inside the item) of every element of the concatenated items."""
    item = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    return item, torch.arange(item.numel()) - _excl_cumsum(lengths)[item]


def _tiles(q0, lq, k0, lk, lo, hi):
    """Cut band segments into tiles of at most ``TILE`` query rows, each keeping only its keys."""
    ntiles = (lq + TILE - 1) // TILE
    seg, t = _expand(ntiles)
    x0 = t * TILE
    x1 = torch.minimum(x0 + TILE, lq[seg])
    lo_s, hi_s = lo[seg], hi[seg]
    y0 = torch.clamp(x0 + lo_s, min=0)
    y1 = torch.minimum(x1 - 1 + hi_s, lk[seg] - 1) + 1
    return q0[seg] + x0, x1 - x0, k0[seg] + y0, y1 - y0, lo_s + x0 - y0, hi_s + x0 - y0


def _pack_class(q0, lq, k0, lk, lo, hi, nq: int, nk: int, cls: int) -> _Pack:
    # consecutive items whose first query row falls in the same cls-wide window share a pack
    start = _excl_cumsum(lq)
    pack = torch.div(start, cls, rounding_mode="floor")
    pack = torch.unique_consecutive(pack, return_inverse=True)[1]
    npacks = int(pack[-1]) + 1
    q_in = start - _excl_cumsum(torch.zeros(npacks, dtype=torch.int64).index_add_(0, pack, lq))[pack]
    k_start = _excl_cumsum(lk)
    k_tot = torch.zeros(npacks, dtype=torch.int64).index_add_(0, pack, lk)
    k_in = k_start - _excl_cumsum(k_tot)[pack]
    q_tot = torch.zeros(npacks, dtype=torch.int64).index_add_(0, pack, lq)
    cq, ck = int(q_tot.max()), int(k_tot.max())

    item_q, x = _expand(lq)
    flat_q = pack[item_q] * cq + q_in[item_q] + x
    q_index = torch.full((npacks * cq,), nq, dtype=torch.int64)
    q_index[flat_q] = q0[item_q] + x
    row_item = torch.full((npacks * cq,), -1, dtype=torch.int64)
    row_item[flat_q] = item_q
    row_x = torch.zeros(npacks * cq, dtype=torch.int64)
    row_x[flat_q] = x

    item_k, y = _expand(lk)
    flat_k = pack[item_k] * ck + k_in[item_k] + y
    k_index = torch.full((npacks * ck,), nk, dtype=torch.int64)
    k_index[flat_k] = k0[item_k] + y
    col_item = torch.full((npacks * ck,), -2, dtype=torch.int64)
    col_item[flat_k] = item_k
    col_y = torch.zeros(npacks * ck, dtype=torch.int64)
    col_y[flat_k] = y

    ri, rx = row_item.view(npacks, cq, 1), row_x.view(npacks, cq, 1)
    ci, cy = col_item.view(npacks, 1, ck), col_y.view(npacks, 1, ck)
    d = cy - rx
    safe = torch.clamp(ri, min=0)
    mask = (ri == ci) & (d >= lo[safe]) & (d <= hi[safe])
    mask[:, :, 0] |= row_item.view(npacks, cq) < 0  # padding rows see the first key of their pack
    return _Pack(q_index, k_index, mask.unsqueeze(1), npacks, cq, ck)


def _uniform_class(q0, k0, lq: int, lk: int, lo: int, hi: int) -> _Pack:
    """Items of one shape and band: one item per pack, no padding, one shared mask."""
    from .masks import _ranges

    count = q0.numel()
    d = torch.arange(lk).unsqueeze(0) - torch.arange(lq).unsqueeze(1)
    mask = ((d >= lo) & (d <= hi)).view(1, 1, lq, lk)
    return _Pack(_ranges(q0, torch.full((count,), lq)), _ranges(k0, torch.full((count,), lk)), mask, count, lq, lk)


def _split_uniform(items):
    """Pull the repeated tiles of long bands (one shape, one band) out of ``items``:
    returns the uniform classes and the remaining items."""
    q0, lq, k0, lk, lo, hi = items
    lo_c = torch.maximum(lo, -lq)  # equal masks, equal signatures, also when unbounded
    hi_c = torch.minimum(hi, lk)
    sig = torch.stack([lq, lk, lo_c, hi_c], 1)
    uniq, inverse, counts = torch.unique(sig, dim=0, return_inverse=True, return_counts=True)
    chosen = (counts >= UNIFORM_COUNT) & (uniq[:, 0] >= UNIFORM_ROWS)
    classes = []
    for u in chosen.nonzero().flatten().tolist():
        sel = inverse == u
        a, b, c, d = uniq[u].tolist()
        classes.append(_uniform_class(q0[sel], k0[sel], a, b, c, d))
    rest = ~chosen[inverse]
    return classes, tuple(t[rest] for t in items)


def schedule(segs: Segments) -> _Schedule:
    """How ``segs`` is covered by direct calls and packs (cached on ``segs``)."""
    cached = getattr(segs, "_schedule", None)
    if cached is not None:
        return cached
    lq, lk = segs.lq, segs.lk
    lo, hi = segs.offsets()
    q0, k0 = segs.cu_q[:-1], segs.cu_k[:-1]
    full = (segs.wl < 0) & (segs.wr < 0)
    causal = (segs.wl < 0) & (segs.wr == 0) & (lq == lk)
    direct = (full | causal) & (lq * lk >= DIRECT_ENTRIES)
    direct_calls = [
        (int(a), int(a + n), int(c), int(c + m), bool(cz))
        for a, n, c, m, cz in zip(q0[direct].tolist(), lq[direct].tolist(), k0[direct].tolist(),
                                  lk[direct].tolist(), causal[direct].tolist())
    ]
    rest = ~direct
    items = _tiles(q0[rest], lq[rest], k0[rest], lk[rest], lo[rest], hi[rest])
    nq, nk = int(segs.cu_q[-1]), int(segs.cu_k[-1])
    packs, items = _split_uniform(items) if items[1].numel() else ([], items)
    if items[1].numel():
        size = torch.maximum(items[1], torch.clamp(items[3], max=TILE))
        cls = torch.clamp(2 ** torch.ceil(torch.log2(size.double())).long(), min=MIN_CLASS)
        for c in torch.unique(cls).tolist():
            sel = cls == c
            packs.append(_pack_class(*(t[sel] for t in items), nq, nk, int(c)))
    result = _Schedule(direct_calls, packs)
    segs._schedule = result
    return result


def _pad_row(x: torch.Tensor) -> torch.Tensor:
    """``x`` ``[b, L, ...]`` with one zero row appended on dim 1."""
    return torch.cat([x, x.new_zeros((x.size(0), 1) + tuple(x.shape[2:]))], dim=1)


def _gather(x_ext: torch.Tensor, index: torch.Tensor, packs: int, width: int) -> torch.Tensor:
    """Rows ``index`` of ``x_ext`` ``[b, L+1, h, d]`` as a batch of packs ``[b * packs, width, h, d]``."""
    b = x_ext.size(0)
    return x_ext.index_select(1, index).view(b * packs, width, *x_ext.shape[2:])


def _batched_mask(p: _Pack, b: int) -> torch.Tensor:
    return p.mask if b == 1 or p.mask.size(0) == 1 else p.mask.unsqueeze(0).expand(b, *p.mask.shape).reshape(b * p.packs, 1, p.cq, p.ck)


def varlen_forward(kernel, q, k, v, segs: Segments, scale: float):
    """``(out [b, Lq, h, d] in q.dtype, lse float32 [b, h, Lq])`` of the varlen call ``segs``."""
    plan = schedule(segs)
    b, nq, h, d = q.shape
    out = q.new_empty(b, nq + 1, h, d)
    lse = torch.empty(b, h, nq + 1, dtype=torch.float32, device=q.device)
    for q0, q1, k0, k1, causal in plan.direct:
        o, l = kernel.forward(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], causal, scale)
        out[:, q0:q1] = o
        lse[:, :, q0:q1] = l
    if plan.packs:
        q_ext, k_ext, v_ext = _pad_row(q), _pad_row(k), _pad_row(v)
        for p in plan.packs:
            qi, ki = p.q_index.to(q.device), p.k_index.to(q.device)
            o, l = kernel.forward_masked(_gather(q_ext, qi, p.packs, p.cq), _gather(k_ext, ki, p.packs, p.ck),
                                         _gather(v_ext, ki, p.packs, p.ck), _batched_mask(p, b).to(q.device), scale)
            out.index_copy_(1, qi, o.reshape(b, p.packs * p.cq, h, d))
            lse.index_copy_(2, qi, l.view(b, p.packs, h, p.cq).transpose(1, 2).reshape(b, h, p.packs * p.cq))
    return out[:, :nq], lse[:, :, :nq]


def varlen_backward(kernel, dout, q, k, v, out, lse, segs: Segments, scale: float):
    """``(dq, dk, dv)`` of the varlen call ``segs`` given the *final* ``out``/``lse`` of its rows;
    float32, shaped like ``q``/``k``/``v``."""
    plan = schedule(segs)
    b, nq, h, d = q.shape
    dq = torch.zeros(b, nq + 1, h, d, dtype=torch.float32, device=q.device)
    dk = torch.zeros(b, k.size(1) + 1, *k.shape[2:], dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for q0, q1, k0, k1, causal in plan.direct:
        g = kernel.backward(dout[:, q0:q1], q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], out[:, q0:q1],
                            lse[:, :, q0:q1], causal, scale)
        dq[:, q0:q1] += g[0]
        dk[:, k0:k1] += g[1]
        dv[:, k0:k1] += g[2]
    if plan.packs:
        q_ext, k_ext, v_ext = _pad_row(q), _pad_row(k), _pad_row(v)
        do_ext, o_ext = _pad_row(dout), _pad_row(out)
        lse_ext = torch.cat([lse, lse.new_zeros(b, h, 1)], dim=2)
        for p in plan.packs:
            qi, ki = p.q_index.to(q.device), p.k_index.to(q.device)
            lse_p = lse_ext.index_select(2, qi).view(b, h, p.packs, p.cq).transpose(1, 2).reshape(b * p.packs, h, p.cq)
            g = kernel.backward_masked(
                _gather(do_ext, qi, p.packs, p.cq), _gather(q_ext, qi, p.packs, p.cq),
                _gather(k_ext, ki, p.packs, p.ck), _gather(v_ext, ki, p.packs, p.ck),
                _gather(o_ext, qi, p.packs, p.cq), lse_p.contiguous(), _batched_mask(p, b).to(q.device), scale)
            dq.index_add_(1, qi, g[0].reshape(b, p.packs * p.cq, h, d).float())
            dk.index_add_(1, ki, g[1].reshape(b, p.packs * p.ck, *k.shape[2:]).float())
            dv.index_add_(1, ki, g[2].reshape(b, p.packs * p.ck, *k.shape[2:]).float())
    return dq[:, :nq], dk[:, :-1], dv[:, :-1]


# -- kernels with a native varlen entry point (flash-attn, PyTorch's CUDA flash op) ------------

def _window_groups(segs: Segments):
    """Segment ids grouped by their window ``(wl, wr)``: one native varlen call per group."""
    keys = segs.wl * (1 << 32) + (segs.wr + 1)
    for key in torch.unique(keys).tolist():
        ids = (keys == key).nonzero().flatten()
        yield int(segs.wl[ids[0]]), int(segs.wr[ids[0]]), ids


def _group_rows(cu: torch.Tensor, ids: torch.Tensor, length: int, batch: int, device):
    """Rows (in the ``[b * L]`` flattening) of segments ``ids``, every batch row in turn, and the
    group's own cu_seqlens (int32) and largest segment."""
    from .masks import _ranges

    lens = (cu[1:] - cu[:-1])[ids]
    rows = _ranges(cu[:-1][ids], lens)
    rows = torch.cat([rows + i * length for i in range(batch)])
    lens_b = lens.repeat(batch)
    cu_g = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens_b, 0)])
    return rows.to(device), cu_g.to(device=device, dtype=torch.int32), int(lens.max())


def native_varlen_forward(call, q, k, v, segs: Segments):
    """Run ``call(q, k, v, cu_q, cu_k, max_q, max_k, wl, wr) -> (out [T, h, d], lse [h, T])`` once
    per window group on the gathered rows; returns ``(out, lse)`` as :func:`varlen_forward`."""
    b, nq, h, d = q.shape
    nk = k.size(1)
    qf, kf, vf = q.reshape(b * nq, h, d), k.reshape(b * nk, *k.shape[2:]), v.reshape(b * nk, *v.shape[2:])
    out = q.new_empty(b * nq, h, d)
    lse = torch.empty(h, b * nq, dtype=torch.float32, device=q.device)
    for wl, wr, ids in _window_groups(segs):
        qr, cu_q, mq = _group_rows(segs.cu_q, ids, nq, b, q.device)
        kr, cu_k, mk = _group_rows(segs.cu_k, ids, nk, b, q.device)
        o, l = call(qf.index_select(0, qr), kf.index_select(0, kr), vf.index_select(0, kr), cu_q, cu_k, mq, mk, wl, wr)
        out.index_copy_(0, qr, o)
        lse.index_copy_(1, qr, l[:, : qr.numel()].float())
    return out.view(b, nq, h, d), lse.view(h, b, nq).transpose(0, 1).contiguous()


def native_varlen_backward(call, dout, q, k, v, out, lse, segs: Segments):
    """``call(dout, q, k, v, out, lse [h, T], cu_q, cu_k, max_q, max_k, wl, wr) -> (dq, dk, dv)`` per
    window group; returns float32 ``(dq, dk, dv)`` as :func:`varlen_backward`."""
    b, nq, h, d = q.shape
    nk = k.size(1)
    flat = lambda x, n: x.reshape(b * n, *x.shape[2:])  # noqa: E731
    qf, kf, vf, dof, of = flat(q, nq), flat(k, nk), flat(v, nk), flat(dout, nq), flat(out, nq)
    lf = lse.transpose(0, 1).reshape(h, b * nq)
    dq = torch.zeros(qf.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(kf.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for wl, wr, ids in _window_groups(segs):
        qr, cu_q, mq = _group_rows(segs.cu_q, ids, nq, b, q.device)
        kr, cu_k, mk = _group_rows(segs.cu_k, ids, nk, b, q.device)
        g = call(dof.index_select(0, qr), qf.index_select(0, qr), kf.index_select(0, kr), vf.index_select(0, kr),
                 of.index_select(0, qr), lf.index_select(1, qr).contiguous(), cu_q, cu_k, mq, mk, wl, wr)
        dq.index_add_(0, qr, g[0].float())
        dk.index_add_(0, kr, g[1].float())
        dv.index_add_(0, kr, g[2].float())
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
