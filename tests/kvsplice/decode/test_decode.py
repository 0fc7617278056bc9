"""The one decoder and the method interface: every method through ``kvsplice.decode.Decoder`` on HF Llama (GQA +
RoPE), HF GPT-2 and our GPT (MHA, MLA, KVSplice); ``cache.position`` drives positions; the one ``generate`` loop and
its argument checks; a method added as one small class (K-norm selection)."""

import math

import pytest
import torch
import transformers
from tiny_models import sharpen as _sharpen

from kvsplice.decode import CompressionMethod, Decoder, DenseKV, ModelAttention, perplexity
from kvsplice.lowrank.bases import HeadBases, KVBases
from kvsplice.lowrank.method import LowRank
from kvsplice.online.method import OnlineFD
from kvsplice.select.knorm import KnormSelector
from kvsplice.select.method import TokenSelection, run_token_selection
from kvsplice.select.selectors import StreamingLLMSelector, make_selector
from models import GPT, GPTConfig

V = 61




def llama():
    torch.manual_seed(0)
    return _sharpen(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)))


def gpt2():
    torch.manual_seed(0)
    return _sharpen(transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=V, n_positions=64, n_embd=32,
                                                                         n_layer=2, n_head=4)))


def ours(attention="mha", **kw):
    torch.manual_seed(0)
    return _sharpen(GPT(GPTConfig(vocab_size=V, n_layer=2, n_head=4, d_model=32, block_size=64, attention=attention,
                                  **kw)))


MODELS = {"llama": llama, "gpt2": gpt2, "gpt": ours}


def logits_of(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def ids_of(b, t, seed=0):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def identity_bases(n_layer, n_kv, d, rope):
    eye = torch.eye(d)
    return KVBases([[HeadBases(eye, eye, eye, eye) for _ in range(n_kv)] for _ in range(n_layer)], "identity", rope)


def lossless_methods(family):
    """Every method at a setting where it must reproduce the model exactly."""
    n_kv = 2 if family == "llama" else 4
    rope = "post" if family == "llama" else "none"
    out = {"dense": DenseKV(), "lowrank-absorb": LowRank(identity_bases(2, n_kv, 8, rope)),
           "lowrank-naive": LowRank(identity_bases(2, n_kv, 8, rope), impl="naive"),
           "fd-online": OnlineFD(rank_k=8, rank_v=8, warmup=0, tau_k=0.0, tau_v=0.0),
           "select": TokenSelection(StreamingLLMSelector(n_sink=2), budget=100),
           "knorm": TokenSelection(KnormSelector(), budget=100)}
    if family == "llama":
        out["lowrank-pre"] = LowRank(identity_bases(2, n_kv, 8, "pre"))
    return out


@pytest.mark.parametrize("family", list(MODELS))
def test_every_method_through_one_decoder_reproduces_the_model(family):
    model = MODELS[family]()
    ids = ids_of(2, 24, 1)
    want = logits_of(model, ids)
    for name, method in lossless_methods(family).items():
        dec = Decoder(model, method)
        cache = dec.new_cache(2)
        got = torch.cat([dec(ids[:, :16], cache), dec(ids[:, 16:20], cache), dec(ids[:, 20:21], cache),
                         dec(ids[:, 21:], cache)], dim=1)  # prefill, a chunk, one token, the rest
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"{family} {name}")
        assert cache.position == 24, name


@pytest.mark.parametrize("attention,kw", [("mha", {}), ("mla", {"d_latent": 16}),
                                          ("mla", {"d_latent": 16, "kvsplice_keep": 0.5})])
def test_model_attention_is_the_models_own_cache(attention, kw):
    model = ours(attention, **kw)
    ids = ids_of(2, 20, 2)
    dec = Decoder(model)  # method=None: ModelAttention for models.GPT
    assert isinstance(dec.method, ModelAttention)
    cache = dec.new_cache(2)
    assert type(cache) is type(model.new_cache(2))
    got = torch.cat([dec(ids[:, :12], cache), dec(ids[:, 12:], cache)], dim=1)
    torch.testing.assert_close(got, logits_of(model, ids), atol=1e-4, rtol=0)
    prompt = ids[:1, :5]
    assert torch.equal(dec.generate(prompt, 8), model.generate(prompt, 8, temperature=0))


def test_position_is_the_next_absolute_position():
    model = ours()
    cache = model.new_cache(1)
    model(ids_of(1, 10), cache=cache)
    assert cache.position == cache.seq_len == 10
    cache.truncate(7)
    assert cache.position == 7  # rolled back
    # a method that drops tokens: 20 prompt tokens, 6 kept; the next token sits at position 20, not 6
    dec = Decoder(model, TokenSelection(StreamingLLMSelector(n_sink=2), budget=6))
    cache = dec.new_cache(1)
    ids = ids_of(1, 21, 3)
    dec(ids[:, :20], cache)
    assert cache.seq_len == 6 and cache.position == 20
    # the kept tokens are sinks 0-1 and 16-19: the same as the model with that attention pattern at position 20
    keep = [0, 1, 16, 17, 18, 19, 20]
    with torch.no_grad():
        ref = model(ids[:, keep], cache=None)  # wrong positions (0..6) ...
    out = dec(ids[:, 20:], cache)
    assert not torch.allclose(out[:, -1], ref[:, -1], atol=1e-3)  # ... so position-from-seq_len would be wrong
    # the right reference: full model over all 21 tokens with the dropped keys masked out
    want = _masked_reference(model, ids, keep)
    torch.testing.assert_close(out[:, -1], want, atol=1e-4, rtol=0)


def _masked_reference(model, ids, keep):
    """Last-token logits of ``model`` over ``ids`` where the last query sees only the ``keep`` positions (every
    earlier query sees its full causal past: the kept tokens' keys/values are the exact prefill ones)."""
    t = ids.shape[1]
    tr = model.transformer
    x = tr.wte(ids) + tr.wpe(torch.arange(t))
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    mask[-1] = False
    mask[-1, keep] = True
    with torch.no_grad():
        for block in tr.h:
            a = block.attn
            h = block.ln_1(x)
            q, k, v = a.c_attn(h).split(32, dim=-1)
            q, k, v = (z.view(1, t, 4, 8).transpose(1, 2) for z in (q, k, v))  # (1, H, T, hs)
            s = (q @ k.transpose(-1, -2)) * a.scale
            y = s.masked_fill(~mask, float("-inf")).softmax(-1) @ v  # (1, H, T, hs)
            x = x + a.c_proj(y.transpose(1, 2).reshape(1, t, 32))
            x = x + block.mlp(block.ln_2(x))
        return model.lm_head(tr.ln_f(x))[:, -1]


def test_generate_refuses_bad_arguments_in_one_line():
    model = ours()
    dec = Decoder(model, DenseKV())
    prompt = ids_of(1, 4)
    bad = [(dict(max_new_tokens=-1), "max_new_tokens"), (dict(max_new_tokens=2, temperature=float("nan")),
                                                        "temperature"),
           (dict(max_new_tokens=2, temperature=-0.5), "temperature"), (dict(max_new_tokens=2, top_k=0), "top_k"),
           (dict(max_new_tokens=2, temperature=1.0, top_k=-3), "top_k")]
    for gen in (dec.generate, model.generate):
        for kw, what in bad:
            with pytest.raises(ValueError, match=what) as e:
                gen(prompt, **kw)
            assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="non-empty"):
            gen(torch.zeros(1, 0, dtype=torch.long), 2)
        with pytest.raises(ValueError, match="outside the model's vocabulary"):
            gen(torch.tensor([[1, V]]), 2)
        with pytest.raises(ValueError, match="integers"):
            gen(torch.zeros(1, 3), 2)
    assert torch.equal(dec.generate(prompt, 0), prompt)
    with pytest.raises(ValueError, match="cache holds torch.float16"):
        model(prompt, cache=model.new_cache(1, dtype=torch.float16))


def test_generate_bounds_the_length_before_allocating(monkeypatch):
    """``max_new_tokens=10**9`` is refused in one line before the cache exists: past the model's positions, and
    (a model without a position limit) when its cache would not fit in the free memory."""
    model = ours()
    dec = Decoder(model, DenseKV())
    made = []
    monkeypatch.setattr(dec, "new_cache", lambda *a, **k: made.append(k) or (_ for _ in ()).throw(AssertionError))
    with pytest.raises(ValueError, match=r"^max_new_tokens=1000000000: a prompt of 4 tokens \+ 1000000000 new "
                                         r"exceeds the model's \d+ positions$"):
        dec.generate(ids_of(1, 4), 10**9)
    monkeypatch.setattr(dec.adapter, "max_positions", None)
    with pytest.raises(ValueError, match=r"^max_new_tokens=1000000000000: a cache of 1000000000003 tokens needs "
                                         r"about .* TB, more than the .* this machine has free$"):
        dec.generate(ids_of(1, 4), 10**12)
    assert made == []


def test_a_method_is_one_class_and_plugs_into_the_decoder():
    """A new compression method without a new driver: K-norm selection is a ~25-line selector class."""
    sel = KnormSelector(n_sink=1)
    k = torch.tensor([[[3.0, 0.0], [1.0, 0.0], [0.5, 0.0], [2.0, 0.0], [0.1, 0.0]]])  # (1, 5, 2), norms 3,1,.5,2,.1
    idx, logw = sel.select(k, k, 3)
    assert idx.tolist() == [[0, 2, 4]] and torch.equal(logw, torch.zeros(1, 3))  # sink 0 + the two smallest norms
    assert KnormSelector().select(k, k, 2)[0].tolist() == [[2, 4]]
    assert make_selector("knorm").__class__ is KnormSelector
    model = llama()
    ids = ids_of(2, 40, 5)
    res = run_token_selection(model, ids, KnormSelector(n_sink=2), 12, prompt_len=30)
    assert res.n_keep == 12 and math.isfinite(res.ppl) and res.cache.position == 39
    assert res.cache_nbytes == res.cache.nbytes()
    full = run_token_selection(model, ids, KnormSelector(), 100, prompt_len=30)
    assert res.ppl != full.ppl  # compression changed something ...
    dense = perplexity(Decoder(model, DenseKV()), ids)
    assert full.nll == pytest.approx(_tail_nll(model, ids, 30), abs=1e-4)  # ... and budget >= prompt is exact
    assert math.isfinite(dense)


def _tail_nll(model, ids, p):
    logits = logits_of(model, ids)[:, p - 1:-1]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, V), ids[:, p:].reshape(-1)).item()


def test_decoder_errors():
    with pytest.raises(ValueError, match="unsupported model"):
        Decoder(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="attn_backend"):
        Decoder(ours(), attn_backend="magic")
    with pytest.raises(TypeError, match="CompressionMethod"):
        Decoder(ours(), method=3)
    with pytest.raises(ValueError, match="unknown method 'nosuch'"):  # a string is a method spec
        Decoder(ours(), method="nosuch")
    dec = Decoder(llama(), DenseKV())
    with pytest.raises(TypeError, match="KVCache"):
        dec(ids_of(1, 3), Decoder(llama(), OnlineFD(rank_k=2)).new_cache(1))
    with pytest.raises(ValueError, match="batch size"):
        dec(ids_of(2, 3), dec.new_cache(1))
    with pytest.raises(ValueError, match="positions"):
        dec(ids_of(1, 129), dec.new_cache(1))
    with pytest.raises(ValueError, match="ModelAttention"):
        Decoder(llama(), ModelAttention())
    assert issubclass(DenseKV, CompressionMethod)
