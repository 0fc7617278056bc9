"""The models' decode paths with the split-KV kernel forced on (``decode_kernel="triton"``; CPU: Triton's
interpreter, tests/conftest.py; CUDA when present: compiled) == the eager path (``decode_kernel="eager"``): MHA, GQA,
MQA, MLA absorbed / naive, KVSplice, int8 caches, and the fixed-capacity view (the CUDA-graph step) reading the length
from the device."""

import pytest
import torch

from models import GPT
from models.config import GPTConfig
from models.kernels import DEFAULT_DECODE_KERNEL, triton_missing_reason
from models.static_cache import StaticCacheView

pytestmark = pytest.mark.skipif(triton_missing_reason() is not None, reason=str(triton_missing_reason()))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VARIANTS = {
    "mha": dict(attention="mha"),
    "gqa2": dict(attention="mha", n_kv_head=2),
    "mqa": dict(attention="mha", n_kv_head=1),
    "mla_absorb": dict(attention="mla", d_latent=24),
    "mla_naive": dict(attention="mla", d_latent=24, mla_impl="naive"),
    "kvsplice": dict(attention="mla", d_latent=24, kvsplice_keep=0.5, latent_norm=True),  # 12-dim rows
}


def tiny(kernel: str, **kw) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=97, n_layer=2, n_head=4, d_model=32, block_size=64, decode_kernel=kernel, **kw)
    return GPT(cfg).to(DEVICE).eval()


def _decode(model, ids, prompt, quant=None, view=False):
    """Logits of the prompt's last token and of each later token decoded one at a time."""
    cache = model.new_cache(ids.shape[0], capacity=ids.shape[1] + 1, quant=quant)
    out = [model(ids[:, :prompt], cache=cache)[:, -1]]
    step_cache = StaticCacheView(cache) if view else cache
    for i in range(prompt, ids.shape[1]):
        if view:
            step_cache.sync()
            step_cache.begin_step()
        out.append(model(ids[:, i:i + 1], cache=step_cache)[:, -1])
        if view:
            step_cache.commit()
    return torch.stack(out)


@pytest.mark.parametrize("name, quant", [(n, None) for n in sorted(VARIANTS)] + [("gqa2", "int8"), ("kvsplice", "int8")])
def test_kernel_decode_equals_eager_decode(name, quant):
    ids = torch.randint(0, 97, (2, 20), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    eager, kernel = tiny("eager", **VARIANTS[name]), tiny("triton", **VARIANTS[name])
    with torch.no_grad():
        want = _decode(eager, ids, 17, quant)
        got = _decode(kernel, ids, 17, quant)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    attn = kernel.transformer.h[0].attn
    assert attn.last_backend == "split_kv"


@pytest.mark.parametrize("name, quant", [("mha", "int8"), ("kvsplice", None)])
def test_kernel_step_over_the_fixed_capacity_view_equals_eager(name, quant):
    """The CUDA-graph step's path: the whole storage, the length read from the device (not the bias)."""
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    eager, kernel = tiny("eager", **VARIANTS[name]), tiny("triton", **VARIANTS[name])
    with torch.no_grad():
        want = _decode(eager, ids, 10, quant)
        got = _decode(kernel, ids, 10, quant, view=True)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_auto_keeps_the_eager_path_on_cpu():
    model = tiny("auto", **VARIANTS["mla_absorb"]).cpu()
    with torch.no_grad():
        _decode(model, torch.randint(0, 97, (1, 6)), 5)
    assert model.transformer.h[0].attn.last_backend == "sdpa"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(VARIANTS))
@pytest.mark.parametrize("dtype, quant", [(torch.float16, None), (torch.bfloat16, None), (torch.float16, "int8")])
def test_cuda_graph_kernel_steps_equal_eager_steps(name, dtype, quant):
    """Compiled Triton on CUDA: the CUDA-graph step with the kernel (the length read from the device, one graph for
    every step) == eager SDPA steps, to half-precision round-off."""
    from models.graph_decode import GraphDecoder

    ids = torch.randint(0, 97, (3, 40), generator=torch.Generator().manual_seed(3)).cuda()
    eager = tiny("eager", **VARIANTS[name]).to("cuda", dtype)
    kernel = tiny("auto", **VARIANTS[name]).to("cuda", dtype)
    with torch.no_grad():
        want = _decode(eager, ids, 30, quant)
        cache = kernel.new_cache(3, capacity=41, quant=quant)
        got = [kernel(ids[:, :30], cache=cache)[:, -1]]
        dec = GraphDecoder(kernel, cache)
        got += [dec.step(ids[:, i:i + 1]).clone() for i in range(30, 40)]
    assert kernel.transformer.h[0].attn.last_backend == "split_kv"
    torch.testing.assert_close(torch.stack(got).float(), want.float(), rtol=2e-2, atol=2e-2)


def test_bench_decode_variants_name_the_decode_path():
    """``bench_decode --config NAME:int8:sdpa:graph``: SDPA instead of the kernel, int8 rows, CUDA-graph steps (the
    fixed-capacity view now takes int8 caches)."""
    from kvsplice.report.decode_timing import parse_variant

    v = parse_variant("mla_kvsplice_90:int8:sdpa:graph", 1024)
    assert v.label == "mla_kvsplice_90+int8+sdpa+graph" and v.graph
    assert v.cfg.decode_kernel == "eager" and v.cfg.cache_quant == "int8"
    assert parse_variant("gpt2:graph", 1024).cfg.decode_kernel == DEFAULT_DECODE_KERNEL
    k = parse_variant("mla_kvsplice_90:kernel:graph", 1024)
    assert k.label == "mla_kvsplice_90+kernel+graph" and k.cfg.decode_kernel == "auto"
