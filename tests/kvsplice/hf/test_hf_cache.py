"""kvsplice caches inside HF ``generate()`` (kvsplice.hf): exact at full rank / full budget against transformers'
own DynamicCache, batched left-padded == one at a time, measured bytes == formula, and the same tokens as the
package's own decoder at a real compression (rank 4 on stories260K)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvsplice.decode import Decoder
from kvsplice.hf import CoefficientHFCache, SubsetHFCache
from kvsplice.lowrank import method as lowrank_method
from kvsplice.lowrank.attention import general_attend
from kvsplice.lowrank.bases import HeadBases, KVBases
from kvsplice.lowrank.method import LowRank
from kvsplice.report.memory import measure_cache
from kvsplice.select.selectors import make_selector
from tiny_models import sharpen

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"
needs_stories = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(),
                                   reason=f"stories260K not found under {STORIES}")
V = 97


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0)
    return sharpen(transformers.LlamaForCausalLM(cfg))


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=128, n_embd=32, n_layer=2, n_head=4,
                                  scale_attn_by_inverse_layer_idx=True, pad_token_id=0)
    return sharpen(transformers.GPT2LMHeadModel(cfg))


MODELS = {"llama": tiny_llama, "gpt2": tiny_gpt2}


def random_bases(model, rank: int, rope: str, seed: int = 0, ranks_v=None) -> KVBases:
    """Orthonormal bases (``k_enc = k_dec``, ``v_enc = v_dec``); full rank is lossless. ``ranks_v`` (per layer and
    head) makes the value ranks differ per head."""
    from kvsplice.adapters.registry import adapter_for

    a = adapter_for(model)
    g = torch.Generator().manual_seed(seed)
    layers = []
    for l in range(a.n_layer):
        heads = []
        for j in range(a.n_kv_head):
            rv = rank if ranks_v is None else ranks_v[l][j]
            qk = torch.linalg.qr(torch.randn(a.head_dim, a.head_dim, generator=g))[0][:, :rank]
            qv = torch.linalg.qr(torch.randn(a.head_dim, a.head_dim, generator=g))[0][:, :rv]
            heads.append(HeadBases(qk, qk.clone(), qv, qv.clone()))
        layers.append(heads)
    return KVBases(layers, "random", rope)


def prompts(n: int = 3, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (t,), generator=g) for t in (9, 5, 7)[:n]]


def left_pad(seqs: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad, dtype=torch.long)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, t - len(s):], mask[i, t - len(s):] = s, 1
    return ids, mask


def greedy(model, ids, cache=None, mask=None, n=12, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask if mask is not None else torch.ones_like(ids),
                              past_key_values=cache, max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def caches(model, kind: str):
    """Lossless kvsplice caches: full-rank post-/pre-RoPE bases (Llama) or no-RoPE bases (GPT-2), full budget."""
    rope = ["post", "pre"] if model.config.model_type == "llama" else ["post"]
    out = {f"coeff-{r}": (lambda r=r: CoefficientHFCache(model, random_bases(model, 8, r))) for r in rope}
    out["subset-balancekv"] = lambda: SubsetHFCache(model, make_selector("balancekv"), budget=1000)
    return out


# -------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("family", MODELS)
def test_lossless_caches_generate_the_default_cache_tokens(family):
    model = MODELS[family]()
    ids = prompts(1)[0][None]
    ref = greedy(model, ids, transformers.DynamicCache(config=model.config))
    for name, make in caches(model, family).items():
        cache = make()
        out = greedy(model, ids, cache)
        assert torch.equal(out, ref), name
        m = measure_cache(cache)
        assert m.live_bytes == cache.nbytes() == cache.formula_nbytes() > 0, name


@pytest.mark.parametrize("family", MODELS)
def test_batched_left_padding_equals_one_at_a_time(family):
    model = MODELS[family]()
    seqs = prompts(3)
    ids, mask = left_pad(seqs)
    for name, make in caches(model, family).items():
        batched = greedy(model, ids, make(), mask)
        for i, s in enumerate(seqs):
            alone = greedy(model, s[None], make())
            assert torch.equal(batched[i, ids.shape[1]:], alone[0, len(s):]), (name, i)
    # the compressed (lossy) caches too: the same rows, alone or batched with padding
    lossy = {"coeff-r4": lambda: CoefficientHFCache(model, random_bases(model, 4, "post")),
             "streaming": lambda: SubsetHFCache(model, make_selector("streaming_llm", n_sink=2), budget=4)}
    for name, make in lossy.items():
        batched = greedy(model, ids, make(), mask)
        for i, s in enumerate(seqs):
            alone = greedy(model, s[None], make())
            assert torch.equal(batched[i, ids.shape[1]:], alone[0, len(s):]), (name, i)


def test_logits_match_the_package_decoder_at_rank_4_post_and_pre():
    """Same compression, two drivers: our cache inside HF's forward == kvsplice's own Decoder(LowRank)."""
    model = tiny_llama()
    ids = prompts(1)[0][None]
    nxt = torch.tensor([[5]])
    for rope in ("post", "pre"):
        bases = random_bases(model, 4, rope, ranks_v=[[4, 2], [3, 3]])  # layer 0: per-head groups
        cache = CoefficientHFCache(model, bases)
        with torch.no_grad():
            hf = [model(ids, past_key_values=cache).logits, model(nxt, past_key_values=cache).logits]
            dec = Decoder(model, LowRank(bases))
            c = dec.new_cache(1)
            ours = [dec(ids, c), dec(nxt, c)]
        for a, b in zip(hf, ours):
            torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
        assert cache.nbytes() == c.nbytes() == cache.formula_nbytes()


def test_sampling_eos_and_logits_processors():
    model = tiny_llama()
    ids = prompts(1)[0][None]
    ref = greedy(model, ids, n=6)
    eos = int(ref[0, ids.shape[1] + 2])  # the third generated token becomes EOS: generation stops there
    for name, make in caches(model, "llama").items():
        out = greedy(model, ids, make(), n=12, eos_token_id=eos)
        assert torch.equal(out, ref[:, :ids.shape[1] + 3]), name
        # sampling with top-k / temperature and a repetition penalty: same seed, same tokens as the default cache
        kw = dict(do_sample=True, top_k=5, temperature=0.7, repetition_penalty=1.3, max_new_tokens=10, pad_token_id=0)
        torch.manual_seed(7)
        want = model.generate(ids, **kw)
        torch.manual_seed(7)
        got = model.generate(ids, past_key_values=make(), **kw)
        assert torch.equal(got, want), name


def test_default_cache_still_works_after_switching_and_bad_uses_are_refused():
    model = tiny_llama()
    ids = prompts(1)[0][None]
    ref = greedy(model, ids)
    CoefficientHFCache(model, random_bases(model, 4, "post"))  # switches the model to "kvsplice" attention
    assert model.config._attn_implementation == "kvsplice"
    assert torch.equal(greedy(model, ids), ref)  # untagged calls (DynamicCache) run SDPA
    with pytest.raises(NotImplementedError, match="beam search"):
        greedy(model, ids, CoefficientHFCache(model, random_bases(model, 4, "post")), num_beams=2)
    with pytest.raises(ValueError, match="head dim|KV heads|layers"):
        CoefficientHFCache(model, random_bases(tiny_gpt2(), 8, "post"))
    with pytest.raises(ValueError, match="budget"):
        SubsetHFCache(model, make_selector("uniform"), budget=0)


# ------------------------------------------------------------------------------------------- stories260K
@pytest.fixture(scope="module")
def s260k(tmp_path_factory):
    from kvsplice.convert.llama2c import convert_llama2c

    d = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("s260k"))
    return transformers.AutoModelForCausalLM.from_pretrained(d).eval(), transformers.AutoTokenizer.from_pretrained(d)


@needs_stories
@pytest.mark.parametrize("rope", ["post", "pre"])
def test_stories260k_rank4_bytes_are_half_and_tokens_match_the_decoder(s260k, rope):
    model, tok = s260k
    texts = ["Once upon a time, there was a little girl", "The dog was sad"]
    ids, mask = left_pad([torch.tensor(tok.encode(t)) for t in texts])
    n = 16
    bases = random_bases(model, 4, rope, seed=3)
    cache = CoefficientHFCache(model, bases)
    out = greedy(model, ids, cache, mask, n=n)
    t = ids.shape[1] + n - 1  # tokens held: prompt + generated tokens fed back
    el = 4
    assert cache.seq_len == t
    assert measure_cache(cache).live_bytes == cache.nbytes() == cache.formula_nbytes() \
        == 5 * 4 * (4 + 4) * t * 2 * el == cache.full_nbytes() // 2
    full = transformers.DynamicCache(config=model.config)
    greedy(model, ids, full, mask, n=n)
    full_bytes = sum(x.numel() * x.element_size() for layer in full.layers for x in (layer.keys, layer.values))
    assert cache.nbytes() * 2 == full_bytes
    # the unpadded row decodes as the package's own decoder does with the same bases
    dec = Decoder(model, LowRank(bases))
    for i in range(2):
        row = ids[i][mask[i].bool()][None]
        assert torch.equal(dec.generate(row, n)[0, row.shape[1]:], out[i, ids.shape[1]:]), i


@pytest.mark.parametrize("rope", ["post", "pre"])
def test_decode_fast_path_equals_the_general_path(rope, monkeypatch):
    """The one-token decode path (in-place append, folded scale / inverse rotation) == the general path (the one
    prefill, int8 and per-head groups take), batched with left padding; int8 still measures bytes == formula."""
    model = tiny_llama()
    ids, mask = left_pad(prompts(3))
    bases = random_bases(model, 4, rope, seed=5)

    def logits(cache):
        m, out = mask.clone(), []
        with torch.no_grad():
            o = model(ids, attention_mask=m, past_key_values=cache)
            for _ in range(6):
                out.append(o.logits[:, -1])
                nxt = o.logits[:, -1].argmax(-1, keepdim=True)
                m = torch.cat([m, torch.ones_like(nxt)], 1)
                o = model(nxt, attention_mask=m, past_key_values=cache)
        return torch.stack(out)

    fast = logits(CoefficientHFCache(model, bases))
    with monkeypatch.context() as m:
        m.setattr(lowrank_method, "coefficient_attend", general_attend)
        torch.testing.assert_close(fast, logits(CoefficientHFCache(model, bases)), atol=1e-5, rtol=1e-5)
    q8 = CoefficientHFCache(model, bases, cache_quant="int8")
    greedy(model, ids, q8, mask, n=4)
    assert q8.nbytes() == q8.formula_nbytes() == measure_cache(q8).live_bytes > 0


@needs_stories
@pytest.mark.parametrize("method, kw", [("streaming_llm", {"n_sink": 4}), ("uniform", {}), ("balancekv", {})])
def test_stories260k_token_subsets_bytes_and_tokens_match_the_decoder(s260k, method, kw):
    """Token subsets inside generate() on the real GQA + RoPE model: a full budget gives the default cache's tokens;
    budget 8 holds 8 + generated tokens per KV head (bytes == formula, measured) and decodes as the package's own
    Decoder(TokenSelection) does for an unpadded row."""
    from kvsplice.decode import Decoder
    from kvsplice.select.method import TokenSelection

    model, tok = s260k
    texts = ["Once upon a time, there was a little girl named Lily. She", "The dog was sad because the ball"]
    ids, mask = left_pad([torch.tensor(tok.encode(t)) for t in texts])
    n = 12
    ref = greedy(model, ids, transformers.DynamicCache(config=model.config), mask, n=n)
    full = SubsetHFCache(model, make_selector(method, **kw), budget=1000)
    assert torch.equal(greedy(model, ids, full, mask, n=n), ref)
    cache = SubsetHFCache(model, make_selector(method, **kw), budget=8)
    out = greedy(model, ids, cache, mask, n=n)
    held = 8 + n - 1  # the kept prompt tokens + the generated tokens fed back
    assert cache.seq_len == held
    assert measure_cache(cache).live_bytes == cache.nbytes() == cache.formula_nbytes() \
        == 5 * 2 * 4 * held * (8 + 8 + 1) * 4  # layers · batch · KV heads · tokens · (k + v + log-weight) · fp32
    dec = Decoder(model, TokenSelection(make_selector(method, **kw), 8))
    row = ids[0][mask[0].bool()][None]  # the longer prompt (no padding)
    assert torch.equal(dec.generate(row, n)[0, row.shape[1]:], out[0, ids.shape[1]:])
