"""The algebra behind "KVSplice from scratch does not beat a smaller latent": without a norm between ``w_dkv`` and
the compress, a KVSplice-r model of a d-dim latent is exactly an MLA model with an r-dim latent (same logits, same
cache bytes); with ``kvsplice_norm`` it is MLA-r with ``latent_norm``."""

import pytest
import torch

from kvsplice.convert.mla import kvsplice_as_mla
from models import GPT
from models.config import GPTConfig


@pytest.mark.parametrize("norm_after", [False, True])
def test_kvsplice_is_a_smaller_mla(norm_after):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=61, n_layer=2, n_head=4, d_model=32, block_size=32, attention="mla", d_latent=16,
                    kvsplice_keep=0.5, kvsplice_norm=norm_after)
    model = GPT(cfg).eval()
    for p in model.parameters():  # away from init: biases and norm weights non-trivial
        p.data.add_(0.05 * torch.randn_like(p))
    mla = kvsplice_as_mla(model)
    assert (mla.cfg.d_latent, mla.cfg.kvsplice_keep, mla.cfg.latent_norm) == (8, None, norm_after)
    ids = torch.randint(0, 61, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(mla(ids), model(ids), rtol=1e-4, atol=1e-5)
        c1, c2 = model.new_cache(2), mla.new_cache(2)
        model(ids, cache=c1)
        mla(ids, cache=c2)
    assert c1.nbytes() == c2.nbytes()
    torch.testing.assert_close(c2.get(0)["c"], c1.get(0)["c"], rtol=1e-4, atol=1e-5)  # the same cached vectors
    w = model.transformer.h[0].attn
    product = w.splice.compress_weight() @ w.w_dkv.weight  # (8, 32): the cached map's rank is at most 8
    assert torch.linalg.matrix_rank(product) == 8


def test_latent_norm_between_is_refused():
    model = GPT(GPTConfig(vocab_size=61, n_layer=1, n_head=2, d_model=16, block_size=8, attention="mla",
                          d_latent=8, kvsplice_keep=0.5, latent_norm=True))
    with pytest.raises(ValueError, match="latent_norm"):
        kvsplice_as_mla(model)
