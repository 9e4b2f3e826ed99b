"""The affine summaries of a chunk's recurrence, their fold into each rank's entry state, and the
correction of the chunk's outputs (state passing, :mod:`.state_passing`).

Every step of these recurrences is affine in the state ``h``: over a chunk, ``h_exit = M h_entry + F``,
where ``F`` is the chunk's final state from a zero state (what the model's kernel returns) and ``M``
the product of its steps' transitions.  Rank ``r``'s entry state folds its predecessors' summaries,
``h = M_j h + F_j`` for ``j = 0 .. r - 1``, and its outputs, computed from a zero state, gain the
entry state's part, which is linear in it: ``y_t += R_t h_entry``.

* **scalar decay per head** (Mamba2's SSD: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``,
  ``y_t = h_t C_t + D x_t``): ``M = exp(sum dt A)`` (a scalar per head), ``R_t h = exp(cumsum dt A)_t h C_t``:
  ``T x P x N`` multiply-adds per head, a fraction of the scan.  :func:`scalar_decay_pass`.
* **gated delta rule** (``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T``, ``o_t = S_t^T q_t``; state
  ``[dk, dv]``): ``M`` is a ``dk x dk`` matrix per head and ``R_t = A_1 A_2 .. A_t q_t`` (every ``A`` is
  symmetric).  Both come in the chunked (WY) form, sub-chunks of 64 tokens: with ``W = (I +
  diag(b) tril(K K^T, -1))^-1 diag(b) K`` and ``g`` the decays' cumulative product in the sub-chunk, the
  sub-chunk's steps are ``g (I - K^T W)`` and its ``R`` rows ``g (Q - tril(Q K^T) W) P`` with ``P`` the
  product before it.  :func:`delta_rule_pass`.

Summaries travel in float32 (float64 for float64 inputs) whatever the model's dtype.  Packed rows:
``plan.cont`` masks the tokens the entry state reaches, ``plan.through_all`` the chunks it crosses.
"""

from __future__ import annotations

import torch

from .state_passing import ContiguousChunks, gather_summaries

__all__ = ["scalar_decay_pass", "delta_rule_pass", "delta_rule_transfer", "fold"]


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def fold(transitions: torch.Tensor, finals: torch.Tensor, plan: ContiguousChunks, apply) -> torch.Tensor:
    """This rank's entry state from every rank's ``(transition, final state)`` (``[N, ...]`` each):
    ``h = apply(M_j, h) + F_j`` over ``j < rank``.  Every rank runs all ``N`` steps, those at and past
    its own weighted by zero, so that every rank's graph (and its backward's collectives) is the same."""
    through = plan.on(finals.device).through_all.to(finals.dtype)  # on the device once per plan
    h = torch.zeros_like(finals[0])
    for j in range(plan.world_size):
        w = 1.0 if j < plan.rank else 0.0
        h = w * (apply(transitions[j] * through[j], h) + finals[j]) + (1.0 - w) * h
    return h


def scalar_decay_pass(y: torch.Tensor, final: torch.Tensor, log_decay: torch.Tensor, C: torch.Tensor,
                      group, plan: ContiguousChunks) -> torch.Tensor:
    """``y`` ``[b, T, H, P]``: the chunk's outputs from a zero state; ``final`` ``[b, H, P, N]``: its final
    state (``h`` with ``y_t = h_t C_t``); ``log_decay`` ``[b, T, H]``: ``dt_t A`` per token (``<= 0``);
    ``C`` ``[b, T, H, N]`` (heads of one group repeated).  Returns ``y`` with the entry state's part."""
    b, t, heads, p = y.shape
    wide = _wide(y.dtype)
    cum = torch.cumsum(log_decay.to(wide), dim=1)                            # [b, T, H]
    summary = torch.cat((cum[:, -1].unsqueeze(-1), final.to(wide).reshape(b, heads, -1)), dim=-1)
    every = gather_summaries(summary, group, plan)                            # [N, b, H, 1 + P N]
    decays, finals = every[..., 0].exp(), every[..., 1:].reshape(plan.world_size, *final.shape)
    entry = fold(decays[..., None, None], finals, plan, lambda m, h: m * h)  # [b, H, P, N]
    reach = cum.exp() * plan.on(y.device).cont.to(wide)[None, :, None]
    fix = torch.einsum("bthn,bhpn->bthp", C.to(wide) * reach[..., None], entry)
    return (y.to(wide) + fix).to(y.dtype)


def _wy(k: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """``W = (I + diag(b) tril(K K^T, -1))^-1 diag(b) K`` per sub-chunk: ``k`` ``[..., L, dk]``,
    ``beta`` ``[..., L]``."""
    low = torch.tril(k @ k.transpose(-1, -2), diagonal=-1) * beta[..., :, None]
    eye = torch.eye(k.size(-2), dtype=k.dtype, device=k.device)
    return torch.linalg.solve_triangular(eye + low, k * beta[..., None], upper=False, unitriangular=True)


def delta_rule_transfer(q: torch.Tensor, k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """``q, k`` ``[b, T, H, dk]`` (as the recurrence uses them: normalised, ``q`` scaled), ``g`` ``[b, T, H]``
    (log decays), ``beta`` ``[b, T, H]`` -> ``R`` ``[b, T, H, dk]`` (``o_t`` gains ``R_t^T S_entry``) and ``M``
    ``[b, H, dk, dk]`` (``S_exit = M S_entry + F``), in the promoted dtype of ``q``."""
    b, t, heads, dk = k.shape
    wide = _wide(q.dtype)
    pad = (-t) % chunk
    q, k = (torch.nn.functional.pad(x.to(wide), (0, 0, 0, 0, 0, pad)) for x in (q, k))
    g, beta = (torch.nn.functional.pad(x.to(wide), (0, 0, 0, pad)) for x in (g, beta))
    n = (t + pad) // chunk
    q, k = (x.reshape(b, n, chunk, heads, dk).permute(0, 3, 1, 2, 4) for x in (q, k))   # [b, H, n, L, dk]
    g, beta = (x.reshape(b, n, chunk, heads).permute(0, 3, 1, 2) for x in (g, beta))    # [b, H, n, L]
    gamma = torch.cumsum(g, dim=-1).exp()
    w = _wy(k, beta)
    local = gamma[..., None] * (q - torch.tril(q @ k.transpose(-1, -2)) @ w)          # [b, H, n, L, dk]
    step = gamma[..., -1, None, None]
    steps = step * (torch.eye(dk, dtype=wide, device=q.device) - k.transpose(-1, -2) @ w)  # [b, H, n, dk, dk]
    P = torch.eye(dk, dtype=wide, device=q.device).expand(b, heads, dk, dk)
    before = [P]
    for c in range(n - 1):
        before.append(steps[:, :, c] @ before[-1])
    R = local @ torch.stack(before, dim=2)                                            # [b, H, n, L, dk]
    R = R.reshape(b, heads, n * chunk, dk)[:, :, :t].transpose(1, 2)
    return R, steps[:, :, n - 1] @ before[-1]


def delta_rule_pass(o: torch.Tensor, final: torch.Tensor, q: torch.Tensor, k: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, group, plan: ContiguousChunks, chunk: int = 64) -> torch.Tensor:
    """``o`` ``[b, T, H, dv]``: the chunk's outputs from a zero state; ``final`` ``[b, H, dk, dv]``: its final
    state; ``q, k, g, beta`` as in :func:`delta_rule_transfer` (one key head per value head).  Returns ``o``
    with the entry state's part."""
    b, t, heads, dv = o.shape
    dk = k.size(-1)
    R, M = delta_rule_transfer(q, k, g, beta, chunk)
    wide = R.dtype
    summary = torch.cat((M.reshape(b, heads, -1), final.to(wide).reshape(b, heads, -1)), dim=-1)
    every = gather_summaries(summary, group, plan)                            # [N, b, H, dk dk + dk dv]
    n = plan.world_size
    Ms = every[..., :dk * dk].reshape(n, b, heads, dk, dk)
    Fs = every[..., dk * dk:].reshape(n, b, heads, dk, dv)
    entry = fold(Ms, Fs, plan, lambda m, s: m @ s)                            # [b, H, dk, dv]
    reach = plan.on(o.device).cont.to(wide)[None, :, None, None]
    fix = torch.einsum("bthk,bhkv->bthv", R * reach, entry)
    return (o.to(wide) + fix).to(o.dtype)
