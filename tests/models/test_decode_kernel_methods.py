"""The compression methods' one-token steps with the split-KV kernel forced on (``decode_kernel="triton"``; CPU:
Triton's interpreter, tests/conftest.py) == the eager path (``"eager"``), through both doors: DenseKV (fp32, int8
rows), LowRank coefficients (R_k != R_v, int8, per-head ranks), a TokenSelection's log-weights over either, and
transformers' padding mask in the HF door."""

import pytest
import torch
import transformers

from kvsplice.decode import Decoder, DenseKV
from kvsplice.hf import KVSpliceHFCache
from kvsplice.lowrank.bases import HeadBases, KVBases
from kvsplice.lowrank.method import LowRank
from kvsplice.select import TokenSelection, make_selector
from models.kernels import triton_missing_reason
from tiny_models import sharpen

pytestmark = pytest.mark.skipif(triton_missing_reason() is not None, reason=str(triton_missing_reason()))

V = 61
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: Triton's interpreter; CUDA: compiled


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the split-KV kernel's launches (proves the kernel path ran, not the eager one)."""
    import models.kernels.split_kv as sk

    calls = []
    real = sk.split_kv_decode
    monkeypatch.setattr(sk, "split_kv_decode", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    return sharpen(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128)), std=0.1).to(DEVICE).eval()


def _bases(ranks_k=(6, 6), ranks_v=(7, 7)) -> KVBases:
    g = torch.Generator().manual_seed(3)
    q = lambda r: torch.linalg.qr(torch.randn(8, 8, generator=g))[0][:, :r].contiguous()  # noqa: E731
    heads = []
    for _ in range(2):
        layer = []
        for rk, rv in zip(ranks_k, ranks_v):
            k, v = q(rk), q(rv)
            layer.append(HeadBases(k, k.clone(), v, v.clone()))
        heads.append(layer)
    return KVBases(heads, "random", "post")


METHODS = {
    "dense": lambda: DenseKV(),
    "dense-int8": lambda: DenseKV(cache_quant="int8"),
    "lowrank": lambda: LowRank(_bases()),  # R_k = 6, R_v = 7: one group per layer
    "lowrank-int8": lambda: LowRank(_bases(), cache_quant="int8"),
    "lowrank-per-head": lambda: LowRank(_bases((6, 5), (7, 8))),  # ranks differ: one stream per KV head
    "select-dense": lambda: TokenSelection(make_selector("balancekv"), 9),  # log-weights
    "select-lowrank-int8": lambda: TokenSelection(make_selector("balancekv"), 9,
                                                  store=LowRank(_bases(), cache_quant="int8")),
}


@pytest.mark.parametrize("name", sorted(METHODS))
def test_method_kernel_steps_equal_eager_steps(llama, name, kernel_calls):
    ids = torch.randint(0, V, (2, 23), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out, launches = {}, {}
    for kernel in ("eager", "triton"):
        dec = Decoder(llama, METHODS[name](), decode_kernel=kernel)
        cache = dec.new_cache(2, capacity=24)
        steps = [dec(ids[:, :20], cache, last_only=True)]  # prefill: the eager path in both
        steps += [dec(ids[:, i:i + 1], cache) for i in range(20, 23)]
        out[kernel], launches[kernel] = torch.cat(steps, 1), len(kernel_calls)
    assert launches["eager"] == 0 and launches["triton"] >= 3 * 2  # every decode step of every layer
    torch.testing.assert_close(out["triton"], out["eager"], rtol=1e-4, atol=1e-4)


def test_hf_door_kernel_with_a_padding_mask_equals_eager(llama, kernel_calls):
    ids = torch.randint(1, V, (2, 12), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    mask = torch.ones_like(ids)
    ids[0, :4], mask[0, :4] = 0, 0  # left padding: the kernel gets it as a -inf key bias
    logits = {}
    for kernel in ("eager", "triton"):
        cache = KVSpliceHFCache(llama, DenseKV(), decode_kernel=kernel)
        with torch.no_grad():
            res = llama.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, do_sample=False,
                                 pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        logits[kernel] = torch.stack(res.logits)
        assert (len(kernel_calls) > 0) == (kernel == "triton")
    torch.testing.assert_close(logits["triton"], logits["eager"], rtol=1e-4, atol=1e-4)


def test_pre_rope_coefficients_keep_the_eager_path(llama, kernel_calls):
    """Pre-RoPE coefficients rebuild and rotate their keys every step: no kernel there, the same logits."""
    from tiny_models import orthonormal_bases

    ids = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(4)).to(DEVICE)
    out = {}
    for kernel in ("eager", "triton"):
        dec = Decoder(llama, LowRank(orthonormal_bases(2, 2, 8, 6, "pre")), decode_kernel=kernel)
        cache = dec.new_cache(2, capacity=10)
        out[kernel] = torch.cat([dec(ids[:, :8], cache, last_only=True), dec(ids[:, 8:9], cache),
                                 dec(ids[:, 9:10], cache)], 1)
    assert len(kernel_calls) == 0
    torch.testing.assert_close(out["triton"], out["eager"], rtol=1e-5, atol=1e-5)
