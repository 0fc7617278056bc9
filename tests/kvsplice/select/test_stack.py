"""The stack — a token subset (any selector) stored as low-rank coefficients quantised to int8 — built from the
existing parts (``TokenSelection(selector, budget, store=LowRank(bases, cache_quant="int8"))``), in both doors:
lossless where every layer is lossless, each lossless layer removable (≡ the stack without it), measured bytes ==
formula, batched left-padded == one at a time, and the same tokens on stories260K in generate() and the Decoder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from kvsplice.decode import Decoder, DenseKV
from kvsplice.hf import KVSpliceHFCache
from kvsplice.lowrank.bases import KVBases
from kvsplice.lowrank.method import LowRank
from kvsplice.report.memory import measure_cache
from kvsplice.select.method import TokenSelection
from kvsplice.select.selectors import make_selector
from tiny_models import orthonormal_bases, sharpen

V = 59
STORIES = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "stories260K"
needs_stories = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(),
                                   reason=f"stories260K not found under {STORIES}")


def tiny(family: str):
    torch.manual_seed(0)
    if family == "llama":
        cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                       max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0)
        return sharpen(transformers.LlamaForCausalLM(cfg))
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=128, n_embd=32, n_layer=2, n_head=4, pad_token_id=0)
    return sharpen(transformers.GPT2LMHeadModel(cfg))


def make_bases(model, rank: int, kind: str = "orthonormal", seed: int = 0) -> KVBases:
    cfg = model.config
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return orthonormal_bases(cfg.num_hidden_layers, n_kv, cfg.hidden_size // cfg.num_attention_heads, rank,
                             "post" if cfg.model_type == "llama" else "none", seed=seed, identity=kind == "identity")


def stack(selector: str, budget: int, bases: KVBases, quant="int8", **sel_kw) -> TokenSelection:
    """The composed method: subset → low-rank coefficients → int8."""
    return TokenSelection(make_selector(selector, **sel_kw), budget, store=LowRank(bases, cache_quant=quant))


def ids_of(b: int, t: int, seed: int) -> torch.Tensor:
    return torch.randint(3, V, (b, t), generator=torch.Generator().manual_seed(seed))


def both_doors(model, method, prompt, steps):
    """Logits of a prefill then one-token steps, through the Decoder and through the HF door (selectors reseeded
    so both draw alike); and the two caches."""
    out = {}
    for door in ("decoder", "hf"):
        if isinstance(method, TokenSelection):
            method.selector.reseed()
        if door == "decoder":
            dec = Decoder(model, method)
            cache = dec.new_cache(prompt.shape[0])
            run = lambda x: dec(x, cache)  # noqa: E731
        else:
            cache = KVSpliceHFCache(model, method)
            run = lambda x: model(x, past_key_values=cache).logits  # noqa: E731
        with torch.no_grad():
            out[door] = ([run(prompt)] + [run(s) for s in steps], cache)
    return out


def assert_same(a, b, atol=2e-5, what=""):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, atol=atol, rtol=1e-5, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_lossless_stack_is_the_model_in_both_doors(family):
    """Full budget, full rank, no quantisation: every layer of the stack is lossless → the model's own logits, and
    in generate() the default cache's tokens."""
    model = tiny(family)
    ids = ids_of(2, 14, 1)
    method = stack("balancekv", 100, make_bases(model, 8), quant=None)
    runs = both_doors(model, method, ids[:, :10], [ids[:, 10:11], ids[:, 11:12]])
    with torch.no_grad():
        want = model(ids[:, :12]).logits
    for door, (logits, _) in runs.items():
        torch.testing.assert_close(torch.cat(logits, 1), want, atol=1e-4, rtol=0, msg=lambda m: f"{door}: {m}")
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids[:1], past_key_values=transformers.DynamicCache(config=model.config), **kw)
        got = model.generate(ids[:1], past_key_values=KVSpliceHFCache(model, method), **kw)
    assert torch.equal(got, ref)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_full_rank_layer_is_removable(family):
    """Full rank: the stack equals the same token subset with full keys/values — int8 with identity bases (the
    coefficient rows are the key/value rows, quantised alike), unquantised with any orthonormal bases."""
    model = tiny(family)
    ids = ids_of(1, 16, 2)
    steps = [ids[:, 12:13], ids[:, 13:14], ids[:, 14:16]]
    sel = dict(n_sink=1, n_recent=2, block_size=4)
    for kind, quant in (("identity", "int8"), ("orthonormal", None)):
        got = both_doors(model, stack("balancekv", 6, make_bases(model, 8, kind), quant, **sel), ids[:, :12], steps)
        ref = both_doors(model, TokenSelection(make_selector("balancekv", **sel), 6,
                                               store=DenseKV(cache_quant=quant)), ids[:, :12], steps)
        for door in ("decoder", "hf"):
            assert_same(got[door][0], ref[door][0], what=f"{family} {kind} {door}")
        assert_same(got["decoder"][0], got["hf"][0], what=f"{family} {kind} decoder vs hf")


def test_a_full_budget_selection_is_removable():
    """Full budget: the selector no longer matters — the stack's logits are the same for every selector, its prefill
    is the model's (exact), and it decodes over low-rank int8 coefficients like the unstacked method does."""
    model = tiny("llama")
    ids = ids_of(2, 13, 3)
    steps = [ids[:, 10:11], ids[:, 11:13]]
    b4 = make_bases(model, 4, seed=5)
    runs = {sel: both_doors(model, stack(sel, 64, b4), ids[:, :10], steps)
            for sel in ("balancekv", "streaming_llm", "uniform", "knorm")}
    with torch.no_grad():
        exact = model(ids[:, :10]).logits
    for sel, run in runs.items():
        for door in ("decoder", "hf"):
            assert_same(run[door][0], runs["balancekv"]["decoder"][0], what=f"{sel} {door}")
        torch.testing.assert_close(run["decoder"][0][0], exact, atol=1e-4, rtol=0)  # exact prefill
    # decode ≡ the unstacked method (low-rank int8) over the exact prefill's keys/values
    dense, plain = Decoder(model, DenseKV()), Decoder(model, LowRank(b4, cache_quant="int8"))
    kv, coef = dense.new_cache(2), plain.new_cache(2)
    dense(ids[:, :10], kv)
    for layer in range(model.config.num_hidden_layers):
        plain.method.append(layer, kv.get(layer)["k"], kv.get(layer)["v"], coef, None)
    assert_same(runs["balancekv"]["decoder"][0][1:], [plain(s, coef) for s in steps], what="vs unstacked")


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_stack_bytes_are_the_formula_and_padding_is_per_row(family):
    model = tiny(family)
    cfg = model.config
    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    seqs = [ids_of(1, t, 10 + t)[0] for t in (15, 9, 12)]
    t_max = 15
    ids = torch.zeros(3, t_max, dtype=torch.long)
    mask = torch.zeros(3, t_max, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, t_max - len(s):], mask[i, t_max - len(s):] = s, 1
    rk, budget, n_new = 3, 6, 5
    method = stack("knorm", budget, make_bases(model, rk, seed=4), n_sink=1)  # deterministic: rows alone == batched
    kw = dict(max_new_tokens=n_new, do_sample=False, pad_token_id=0)
    cache = KVSpliceHFCache(model, method)
    with torch.no_grad():
        batched = model.generate(ids, attention_mask=mask, past_key_values=cache, **kw)
    held = budget + n_new - 1
    # int8: (R_k + R_v) bytes + one fp16 scale per key row and per value row; the log-weight in fp32
    formula = cfg.num_hidden_layers * 3 * n_kv * held * ((rk + rk + 2 * 2) + 4)
    assert cache.seq_len == held and cache.get_seq_length() == t_max + n_new - 1
    assert measure_cache(cache).live_bytes == cache.nbytes() == cache.formula_nbytes() == formula
    assert formula < TokenSelection(make_selector("balancekv"), budget).bind(
        cache.adapter, dtype=torch.float32, device=torch.device("cpu")).bytes_formula(3, held, torch.float32)
    for i, s in enumerate(seqs):  # every padded row decodes as it does alone (HF door and Decoder alike)
        with torch.no_grad():
            alone = model.generate(s[None], past_key_values=KVSpliceHFCache(model, method), **kw)[0, len(s):]
        assert torch.equal(batched[i, t_max:], alone), i
        dec = Decoder(model, method)
        assert torch.equal(dec.generate(s[None], n_new)[0, len(s):], alone), i


@needs_stories
def test_stories260k_stack_in_generate_matches_the_decoder(tmp_path):
    from kvsplice.convert.llama2c import convert_llama2c

    d = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path / "s260k")
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = torch.tensor([tok.encode("Once upon a time, there was a little girl named Lily. She loved to play")])
    method = stack("balancekv", 8, make_bases(model, 4, seed=2))
    n = 12
    method.selector.reseed()
    cache = KVSpliceHFCache(model, method)
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=n, do_sample=False, pad_token_id=0)
    held = 8 + n - 1
    assert measure_cache(cache).live_bytes == cache.nbytes() == cache.formula_nbytes() == 5 * 4 * held * (4 + 4 + 4 + 4)
    method.selector.reseed()
    assert torch.equal(Decoder(model, method).generate(ids, n), out)
