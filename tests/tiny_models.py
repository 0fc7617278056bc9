"""Helpers shared by the tests: tiny decode-test models with peaked attention, and the tiny training options."""

from __future__ import annotations

import torch


def sharpen(model: torch.nn.Module, std: float = 0.25, seed: int = 123) -> torch.nn.Module:
    """Weights larger than the default init so attention is peaked and logits spread (any error shows above 1e-4);
    norms near 1, biases small. Returns the model in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if ("norm" in name or "ln_" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)
    return model.eval()


TINY_FIT_ARGS = [
    "--model.n_layer", "2", "--model.n_head", "2", "--model.d_model", "64", "--model.d_latent", "32",
    "--model.block_size", "64", "--data.batch_size", "8", "--data.val_batches", "4",
    "--data.synthetic_stories", "2000", "--data.synthetic_vocab_size", "512",
    "--trainer.enable_progress_bar", "false", "--trainer.log_every_n_steps", "1",
]
"""``python -m training.fit`` options for a seconds-long run on the embedded synthetic stories."""


def orthonormal_bases(n_layer: int, n_kv_head: int, head_dim: int, rank: int, rope: str, *, seed: int = 0,
                      identity: bool = False):
    """``KVBases`` whose every KV head has orthonormal bases (``k_enc = k_dec``, ``v_enc = v_dec``: the first
    ``rank`` columns of a random orthogonal matrix, or of the identity); full rank reconstructs exactly."""
    from kvsplice.lowrank.bases import HeadBases, KVBases

    g = torch.Generator().manual_seed(seed)

    def pair():
        q = torch.eye(head_dim) if identity else torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g))[0]
        return q[:, :rank].contiguous(), q[:, :rank].clone()

    layers = [[HeadBases(*pair(), *pair()) for _ in range(n_kv_head)] for _ in range(n_layer)]
    return KVBases(layers, "identity" if identity else "random", rope)
