"""Fixed-shape decode: the fixed-capacity cache view equals the normal cached step (CPU), and the CUDA-graph decoder
equals eager decode (GPU)."""

import pytest
import torch

from models import GPT
from models.config import GPTConfig
from models.static_cache import StaticCacheView

VARIANTS = {
    "mha": dict(attention="mha"),
    "gqa2": dict(attention="mha", n_kv_head=2),
    "mla_absorb": dict(attention="mla", d_latent=16),
    "mla_naive": dict(attention="mla", d_latent=16, mla_impl="naive"),
    "kvsplice": dict(attention="mla", d_latent=16, kvsplice_keep=0.5, latent_norm=True),
}


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, n_layer=2, n_head=4, d_model=32, block_size=64, **kw)
    return GPT(cfg).eval()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_static_view_steps_equal_cached_steps(name):
    model = tiny(**VARIANTS[name])
    ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref_cache = model.new_cache(3, capacity=24)
        ref = [model(ids[:, :12], cache=ref_cache)[:, -1]]
        cache = model.new_cache(3, capacity=24)
        out = [model(ids[:, :12], cache=cache)[:, -1]]
        view = StaticCacheView(cache)
        for i in range(12, 20):
            ref.append(model(ids[:, i:i + 1], cache=ref_cache)[:, -1])
            view.sync()
            view.begin_step()
            out.append(model(ids[:, i:i + 1], cache=view)[:, -1])
            view.commit()
    assert cache.seq_len == ref_cache.seq_len == 20 and cache.position == 20
    torch.testing.assert_close(torch.stack(out), torch.stack(ref), rtol=1e-5, atol=1e-5)
    assert cache.nbytes() == ref_cache.nbytes()
    for a, b in zip(cache.tensors(), ref_cache.tensors()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_static_view_truncate_and_full_cache():
    model = tiny(**VARIANTS["mla_absorb"])
    cache = model.new_cache(1, capacity=6)
    ids = torch.randint(0, 97, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids[:, :4], cache=cache)
        view = StaticCacheView(cache)
        view.sync(); view.begin_step(); a = model(ids[:, 4:5], cache=view); view.commit()
        view.truncate(4)  # roll back: the same step again gives the same logits
        view.sync(); view.begin_step(); b = model(ids[:, 4:5], cache=view); view.commit()
        torch.testing.assert_close(a, b)
        view.sync(); view.begin_step(); model(ids[:, 5:6], cache=view); view.commit()
    assert cache.seq_len == 6
    with pytest.raises(ValueError, match="cache is full"):
        view.sync()


@pytest.mark.parametrize("name", ["mha", "kvsplice"])
def test_static_view_of_an_int8_cache_equals_cached_steps(name):
    """int8 rows written at the view's position (values and scales), read dequantised over the whole storage."""
    model = tiny(**VARIANTS[name], decode_kernel="eager")
    ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref_cache, cache = model.new_cache(2, capacity=14, quant="int8"), model.new_cache(2, capacity=14, quant="int8")
        model(ids[:, :8], cache=ref_cache), model(ids[:, :8], cache=cache)
        view = StaticCacheView(cache)
        for i in range(8, 12):
            ref = model(ids[:, i:i + 1], cache=ref_cache)[:, -1]
            view.sync(); view.begin_step()
            torch.testing.assert_close(model(ids[:, i:i + 1], cache=view)[:, -1], ref, rtol=1e-5, atol=1e-5)
            view.commit()
    for a, b in zip(cache.tensors(), ref_cache.tensors()):
        assert torch.equal(a, b)


def test_static_view_uninitialised_rows_are_masked():
    model = tiny(**VARIANTS["mha"])
    cache = model.new_cache(1, capacity=8)
    for layer in range(cache.n_layer):
        for buf in cache.storage(layer).values():
            buf.fill_(float("nan"))  # garbage in the rows never written
    view = StaticCacheView(cache)
    with torch.no_grad():
        view.sync(); view.begin_step()
        logits = model(torch.tensor([[5]]), cache=view)
    assert torch.isfinite(logits).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_generate_equals_eager(name, dtype):
    model = tiny(**VARIANTS[name]).to("cuda", dtype)
    prompt = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(3)).cuda()
    eager = model.generate(prompt, 20, temperature=0)
    graph = model.generate(prompt, 20, temperature=0, cuda_graph=True)
    assert torch.equal(eager, graph)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_steps_equal_eager_logits():
    from models.graph_decode import GraphDecoder

    model = tiny(**VARIANTS["kvsplice"]).cuda()
    ids = torch.randint(0, 97, (2, 30), generator=torch.Generator().manual_seed(4)).cuda()
    with torch.no_grad():
        ref_cache, cache = model.new_cache(2, capacity=30), model.new_cache(2, capacity=30)
        model(ids[:, :10], cache=ref_cache)
        model(ids[:, :10], cache=cache)
        dec = GraphDecoder(model, cache)
        for i in range(10, 30):
            ref = model(ids[:, i:i + 1], cache=ref_cache)[:, -1]
            torch.testing.assert_close(dec.step(ids[:, i:i + 1]), ref, rtol=1e-5, atol=1e-5)
        assert cache.seq_len == 30
        with pytest.raises(ValueError, match="full"):
            dec.step(ids[:, :1])


def test_kvsplice_norm_after_compress_cached_equals_full_forward():
    """``kvsplice_norm``: RMSNorm on the compressed latent; the cache holds the normalised vector and absorbed /
    naive decode equal the full forward."""
    for impl in ("absorb", "naive"):
        model = tiny(attention="mla", d_latent=16, kvsplice_keep=0.5, kvsplice_norm=True, mla_impl=impl)
        ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(5))
        with torch.no_grad():
            full = model(ids)
            cache = model.new_cache(2)
            steps = [model(ids[:, :5], cache=cache)] + [model(ids[:, i:i + 1], cache=cache) for i in range(5, 12)]
        torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)
        s = cache.get(0)["c"]  # (B, T, 8): unit RMS per token (norm weight 1 at init)
        torch.testing.assert_close(s.pow(2).mean(-1), torch.ones(2, 12), rtol=1e-3, atol=1e-3)


def test_decode_kernel_order_and_its_switch_restores_torch_state():
    """The SDPA kernel order a decode call asks for on CUDA (measured on an H100: benchmarks/gpu.py ``sdpa``):
    memory-efficient first for one query over short keys, FlashAttention first for long ones and for prefill, cuDNN
    first for a masked fixed-shape (CUDA-graph) step; the switch restores torch's own order afterwards."""
    from torch.nn.attention import SDPBackend

    from models.attention import DECODE_FLASH_MIN_KEYS, _sdpa_priority, sdpa_order

    assert sdpa_order(1, DECODE_FLASH_MIN_KEYS - 1)[0] == SDPBackend.EFFICIENT_ATTENTION
    assert sdpa_order(1, DECODE_FLASH_MIN_KEYS)[0] == SDPBackend.FLASH_ATTENTION
    assert sdpa_order(256, 256)[0] == SDPBackend.FLASH_ATTENTION  # a prefill chunk
    assert sdpa_order(1, 100, fixed_masked=True)[0] == SDPBackend.CUDNN_ATTENTION
    before = torch._C._get_sdp_priority_order()
    with _sdpa_priority(sdpa_order(1, 100)):
        inside = torch._C._get_sdp_priority_order()
    assert inside[0] == int(SDPBackend.EFFICIENT_ATTENTION) and sorted(inside) == sorted(before)
    assert torch._C._get_sdp_priority_order() == before


def test_flash_dispatch_for_both_flashattention_packages():
    """``backend="flash"`` calls flash-attn 2's ``(out)`` or FlashAttention-4's ``(out, lse)`` ``flash_attn_func``
    in (B, T, H, D) layout with a bottom-right causal mask; checked with stand-ins that compute the same math."""
    from models.attention import FlashImpl, attend

    def reference(q, k, v, softmax_scale, causal, **kw):  # (B, T, H, D) in and out, GQA by repeat
        qh, kh, vh = (x.transpose(1, 2) for x in (q, k, v))  # (B, H, T, D)
        g = qh.shape[1] // kh.shape[1]
        kh, vh = kh.repeat_interleave(g, 1), vh.repeat_interleave(g, 1)
        s = qh @ kh.transpose(-1, -2) * softmax_scale
        tq, tk = s.shape[-2:]
        allowed = torch.arange(tk)[None, :] <= torch.arange(tk - tq, tk)[:, None]
        y = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1) @ vh
        return y.transpose(1, 2)

    q = torch.randn(2, 4, 3, 8)
    k, v = torch.randn(2, 2, 7, 8), torch.randn(2, 2, 7, 8)
    ref = attend(q, k, v, scale=0.3)
    fa2 = FlashImpl("flash-attn-2", reference, (8, 0), returns_lse=False)
    fa4 = FlashImpl("flash-attn-4", lambda *a, **kw: (reference(*a, **kw), None), (9, 0), returns_lse=True)
    for impl in (fa2, fa4):
        torch.testing.assert_close(attend(q, k, v, scale=0.3, backend="flash", flash=impl), ref)
