"""Token-selection decode driver on HF Llama (GQA + RoPE), HF GPT-2 and our MHA GPT: full budget reproduces the
model, a compressed cache equals the model under the equivalent attention mask (so RoPE / learned positions continue
from n_seen), the subset cache's bytes are the formula, chunked decode is exact."""

import math

import pytest
import torch
import transformers
from tiny_models import sharpen as _sharpen

from kvsplice.report.memory import measure_cache
from kvsplice.select.cache import subset_bytes
from kvsplice.select.method import TokenSelectionDecoder, run_token_selection
from reference_token_selection import run_with_token_selection
from kvsplice.select.selectors import BalanceKVSelector, StreamingLLMSelector, UniformSelector
from models import GPT, GPTConfig

V = 61






def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=128, tie_word_embeddings=False)
    return _sharpen(transformers.LlamaForCausalLM(cfg))


def gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=0, eos_token_id=0)
    return _sharpen(transformers.GPT2LMHeadModel(cfg))


def ours():
    torch.manual_seed(0)
    return _sharpen(GPT(GPTConfig(vocab_size=V, n_layer=2, n_head=4, d_model=32, block_size=64, attention="mha")))


MODELS = {"llama": llama, "gpt2": gpt2, "gpt": ours}
SHAPES = {"llama": (2, 2, 8), "gpt2": (2, 4, 8), "gpt": (2, 4, 8)}  # n_layer, Hkv, head_dim


def logits_of(model, ids, **kw):
    with torch.no_grad():
        out = model(ids, **kw)
    return out if isinstance(out, torch.Tensor) else out.logits


def selectors():
    return [BalanceKVSelector(n_sink=2, n_recent=4, block_size=8), UniformSelector(n_sink=2, n_recent=4),
            StreamingLLMSelector(n_sink=2)]


def ids_of(b, t, seed):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", list(MODELS))
def test_full_budget_reproduces_the_model(family):
    model = MODELS[family]()
    ids = ids_of(2, 30, 1)
    full = logits_of(model, ids)
    p = 18
    for sel in selectors():
        dec = TokenSelectionDecoder(model, sel, budget=p)
        cache = dec.new_cache(2, capacity=29)
        pre = dec.prefill(ids[:, :p], cache)
        torch.testing.assert_close(pre, full[:, :p], atol=1e-4, rtol=0)
        out = dec(ids[:, p:29], cache)
        torch.testing.assert_close(out, full[:, p:29], atol=1e-4, rtol=0)
        out2 = dec(ids[:, 29:], cache)  # one more token, one at a time
        torch.testing.assert_close(out2, full[:, 29:], atol=1e-4, rtol=0)
        n_layer, hkv, d = SHAPES[family]
        assert cache.seq_len == cache.n_seen == 30
        assert cache.nbytes() == subset_bytes(n_layer, 2, hkv, d, d, 30) == \
            dec.method.bytes_formula(2, 30, torch.float32) == dec.formula_nbytes(cache)
        res = run_token_selection(model, ids, sel, budget=p, prompt_len=p, return_logits=True)
        torch.testing.assert_close(res.logits, full[:, p - 1:-1], atol=1e-4, rtol=0)
        nll = torch.nn.functional.cross_entropy(full[:, p - 1:-1].reshape(-1, V), ids[:, p:].reshape(-1))
        assert abs(res.nll - nll.item()) < 1e-4 and res.n_scored == 2 * (30 - p) and res.n_keep == p


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_compressed_cache_equals_the_model_under_the_equivalent_mask(family):
    """StreamingLLM keeps the same tokens in every head with weight 1, so decoding over its cache is the HF model
    run with a 4-D mask in which continuation queries cannot see the dropped prompt tokens — with every token at its
    original position. Positions counted from seq_len instead of n_seen would break this."""
    model = MODELS[family]()
    b, t, p, budget, n_sink = 2, 34, 22, 9, 2
    ids = ids_of(b, t, 2)
    res = run_token_selection(model, ids, StreamingLLMSelector(n_sink=n_sink), budget, prompt_len=p,
                              return_logits=True)
    keep = torch.zeros(t, dtype=torch.bool)
    keep[:n_sink] = True
    keep[p - (budget - n_sink):] = True
    allowed = torch.tril(torch.ones(t, t, dtype=torch.bool))
    allowed[p:, :p] &= keep[None, :p]
    ref = logits_of(model, ids, attention_mask=allowed[None, None].expand(b, 1, t, t))
    torch.testing.assert_close(res.logits, ref[:, p - 1:-1], atol=1e-4, rtol=0)
    assert (res.logits - logits_of(model, ids)[:, p - 1:-1]).abs().max() > 1e-2  # compression does change things
    n_layer, hkv, d = SHAPES[family]
    held = budget + (t - 1 - p)
    assert res.cache.seq_len == held and res.cache.n_seen == t - 1
    assert res.cache_nbytes == subset_bytes(n_layer, b, hkv, d, d, held) < res.full_nbytes
    meas = measure_cache(res.cache)
    assert meas.live_bytes == meas.storage_bytes == res.cache_nbytes  # exact capacity: storage is the formula


@pytest.mark.parametrize("family", list(MODELS))
def test_compressed_decode_is_chunk_invariant_and_gqa_selects_per_kv_head(family):
    model = MODELS[family]()
    ids = ids_of(2, 40, 3)
    p, budget = 28, 12
    for sel in selectors():
        sel.reseed(0)
        whole = run_token_selection(model, ids, sel, budget, prompt_len=p, return_logits=True)
        sel.reseed(0)
        steps = run_token_selection(model, ids, sel, budget, prompt_len=p, return_logits=True, decode_chunk=1)
        torch.testing.assert_close(whole.logits, steps.logits, atol=1e-4, rtol=0)
        assert math.isfinite(whole.ppl) and whole.n_keep == budget
        torch.testing.assert_close(whole.logits[:, 0], logits_of(model, ids[:, :p])[:, -1], atol=1e-4, rtol=0)
        n_layer, hkv, d = SHAPES[family]
        assert whole.cache.get(0)["k"].shape == (2, hkv, budget + 40 - 1 - p, d)


def test_matches_the_mha_gpt_driver():
    model = ours()
    ids = ids_of(2, 40, 4)
    for sel in selectors():
        sel.reseed(5)
        a = run_token_selection(model, ids, sel, 12, prompt_len=28, return_logits=True)
        sel.reseed(5)
        b = run_with_token_selection(model, ids, sel, 12, prompt_len=28, return_logits=True)
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)
        assert a.cache_nbytes == b.cache_nbytes


def test_generate_and_errors():
    model = llama()
    dec = TokenSelectionDecoder(model, BalanceKVSelector(n_sink=2, n_recent=4, block_size=8), budget=10)
    out = dec.generate(ids_of(1, 24, 6), max_new_tokens=5)
    assert out.shape == (1, 29)
    full = TokenSelectionDecoder(model, StreamingLLMSelector(), budget=100).generate(ids_of(1, 24, 6), 5)
    with torch.no_grad():
        ref = model.generate(ids_of(1, 24, 6), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(full, ref)
    cache = dec.new_cache(1)
    with pytest.raises(ValueError, match="prefill"):
        dec.decode(ids_of(1, 2, 0), cache)
    dec.prefill(ids_of(1, 20, 0), cache)
    with pytest.raises(ValueError, match="empty cache"):
        dec.prefill(ids_of(1, 20, 0), cache)
    with pytest.raises(ValueError, match="positions"):
        dec(ids_of(1, 120, 0), cache)
    with pytest.raises(ValueError, match="unsupported model family"):
        TokenSelectionDecoder(GPT(GPTConfig(vocab_size=V, n_layer=1, n_head=2, d_model=16, block_size=64,
                                            attention="mla", d_latent=8)), StreamingLLMSelector(), 4)
