"""Absorbed MLA attention over a paged latent cache, in plain PyTorch (no vLLM import): what the vLLM plugin's CPU
backend runs for any ``kv_lora_rank`` and RoPE width.

vLLM's paged cache for MLA is one tensor ``(num_blocks, block_size, L + R)``: per token one row of the normed latent
(``L = kv_lora_rank``) followed by its RoPE key (``R = qk_rope_head_dim``). A sequence's tokens live in the blocks its
row of ``block_table`` names, in order; token ``t`` of a new step is written at flat slot ``slot_mapping[t]``
(``block * block_size + offset``; ``-1`` = a padding token, skipped). Decoding is MQA over that row: the query is the
up-projected ``q_nope · W_UK`` (L numbers per head) next to ``q_pe`` (R), scored against the whole row; the value is
the latent part of the same row, so the output stays in latent space (L per head) for vLLM's ``W_UV`` to lift.
"""

from __future__ import annotations

import torch

__all__ = ["write_latent_cache", "paged_latent_decode"]


def write_latent_cache(cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Write each new token's ``[kv_c ; k_pe]`` row into ``cache`` (``(num_blocks, block_size, L + R)``) at its
    flat slot; slots ``< 0`` (padding) are skipped. ``kv_c``: (T, L); ``k_pe``: (T, R) or (T, 1, R)."""
    if cache.numel() == 0:
        return
    width = cache.shape[-1]
    flat = cache.view(-1, width)  # (num_blocks * block_size, L + R)
    slots = slot_mapping.flatten()[: kv_c.shape[0]].long()
    rows = torch.cat([kv_c, k_pe.reshape(k_pe.shape[0], -1)], dim=-1)  # (T, L + R)
    keep = slots >= 0
    flat.index_copy_(0, slots[keep], rows[keep].to(flat.dtype))


def paged_latent_decode(q_latent: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                        seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode token per sequence: ``softmax(scale · [q_latent ; q_pe] · rowsᵀ) · latents`` over each sequence's
    first ``seq_lens[b]`` cached rows.

    ``q_latent``: (B, N, L) (``q_nope`` already through ``W_UK``), ``q_pe``: (B, N, R), ``cache``:
    (num_blocks, block_size, L + R), ``block_table``: (B, ≥ ceil(max seq_len / block_size)) block ids,
    ``seq_lens``: (B,). Returns (B, N, L) in ``q_latent``'s dtype; scores and softmax in float32 at least."""
    b, n, latent = q_latent.shape
    block_size = cache.shape[1]
    max_len = int(seq_lens.max()) if b else 0
    if b == 0 or max_len == 0:
        return q_latent.new_zeros(b, n, latent)
    n_blocks = -(-max_len // block_size)
    work = torch.promote_types(q_latent.dtype, torch.float32)
    rows = cache[block_table[:, :n_blocks].long()]  # (B, n_blocks, block_size, L + R)
    rows = rows.reshape(b, n_blocks * block_size, -1)[:, :max_len].to(work)  # (B, S, L + R)
    q = torch.cat([q_latent, q_pe], dim=-1).to(work)  # (B, N, L + R)
    scores = torch.bmm(q, rows.transpose(1, 2)) * scale  # (B, N, S)
    pos = torch.arange(max_len, device=cache.device)
    scores.masked_fill_((pos[None, :] >= seq_lens[:, None].to(pos.device))[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # (B, N, S)
    return torch.bmm(probs, rows[..., :latent]).to(q_latent.dtype)  # (B, N, L)
