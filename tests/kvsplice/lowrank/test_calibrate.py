"""Calibration statistics (kvsplice.lowrank.calibrate): Grams from hooks equal Grams of explicitly computed K/Q/V, RoPE
modes, flat memory, model coverage, and a real pretrained GQA + RoPE model (stories260K) when its data is present."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from kvsplice.adapters import model_fingerprint, model_info
from kvsplice.adapters.capture import extract_qkv
from kvsplice.lowrank.calibrate import CalibrationStats, calibrate, calibration_batches, iter_token_batches
from models import GPT
from models.config import GPTConfig

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

REPO = Path(__file__).resolve().parents[3]
DATA = REPO.parent / "shared" / "data"
STORIES = DATA / "stories260K"
VAL_TXT = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"




def gram(x: torch.Tensor) -> torch.Tensor:
    """(B, H, T, d) → (H, d, d) float64 Σ_t x xᵀ."""
    x = x.double()
    return torch.einsum("bhtd,bhte->hde", x, x)


def all_hooks(model: torch.nn.Module) -> list:
    """Every forward (pre-)hook on the model (HF registers a few of its own: compare before/after)."""
    return [(name, h) for name, m in model.named_modules() for d in (m._forward_hooks, m._forward_pre_hooks)
            for h in d.values()]


# --------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64, attn_implementation="eager")
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(1)
    return GPT(GPTConfig(vocab_size=61, n_layer=2, n_head=2, d_model=16, block_size=32, attention="mha")).eval()


@pytest.fixture(scope="module")
def batches():
    g = torch.Generator().manual_seed(2)
    return calibration_batches(torch.randint(0, 61, (3 * 2 * 16 + 5,), generator=g), seq_len=16, batch_size=2)


def llama_manual(model, ids: torch.Tensor, rope: bool) -> list[dict[str, torch.Tensor]]:
    """Keys/queries/values computed by hand from each layer's input (no hooks)."""
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        base = model.model
        pos = torch.arange(ids.shape[1])[None].expand(ids.shape[0], -1)
        res = []
        for l, layer in enumerate(base.layers):
            h = layer.input_layernorm(out.hidden_states[l])
            a = layer.self_attn
            b, t, _ = h.shape
            q = a.q_proj(h).view(b, t, -1, 8).transpose(1, 2)  # (B, H, T, d)
            k = a.k_proj(h).view(b, t, -1, 8).transpose(1, 2)
            v = a.v_proj(h).view(b, t, -1, 8).transpose(1, 2)
            if rope:
                cos, sin = base.rotary_emb(h, pos)
                q, k = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
            res.append({"q": q, "k": k, "v": v})  # (B, H, T, d): the attention layout
    return res


# --------------------------------------------------------------------------------------------------- llama
def test_model_info(llama, gpt):
    i = model_info(llama)
    assert (i.family, i.n_layer, i.n_head, i.n_kv_head, i.head_dim, i.d_model, i.has_rope, i.group_size) == \
        ("llama", 2, 4, 2, 8, 32, True, 2)
    assert model_info(llama.model).family == "llama"  # the bare LlamaModel works too
    j = model_info(gpt)
    assert (j.family, j.n_head, j.n_kv_head, j.head_dim, j.has_rope) == ("gpt", 2, 2, 8, False)


@pytest.mark.parametrize("rope", ["post", "pre"])
def test_llama_grams_match_explicit_kqv(llama, batches, rope):
    hooks = all_hooks(llama)
    stats = calibrate(llama, batches, rope=rope, progress=False)
    assert all_hooks(llama) == hooks  # ours are gone (HF installs a few of its own lazily: compare)
    assert stats.rope == rope and stats.n_tokens == 3 * 2 * 16
    assert (stats.n_head, stats.n_kv_head, stats.head_dim, stats.group_size) == (4, 2, 8, 2)
    for l in range(2):
        kk = qq = vv = qs = 0
        for b in batches:
            m = llama_manual(llama, b, rope=rope == "post")[l]
            kk, qq, vv = kk + gram(m["k"]), qq + gram(m["q"]), vv + gram(m["v"])
            qs = qs + gram(m["q"].reshape(m["q"].shape[0], 2, 2, -1, 8).sum(2))  # heads (0,1) → kv 0, (2,3) → kv 1
        for name, want in (("kk", kk), ("qq", qq), ("vv", vv), ("qsum", qs)):
            torch.testing.assert_close(getattr(stats, name)[l], want, rtol=1e-6, atol=1e-8, msg=name)
        wo = llama.model.layers[l].self_attn.o_proj.weight.double()
        for h in range(4):
            torch.testing.assert_close(stats.wo[l, h], wo[:, 8 * h:8 * (h + 1)])
        # the group Grams: concat = Σ of the two heads' Grams; sum has the cross terms
        torch.testing.assert_close(stats.query_gram(l, 1, "concat"), qq[2] + qq[3])
        assert not torch.allclose(stats.query_gram(l, 1, "sum"), qq[2] + qq[3])


def test_llama_post_rope_keys_reproduce_the_models_attention(llama, batches):
    """The post-RoPE q/k the hooks see give exactly the eager model's attention probabilities."""
    ids = batches[0]
    qkv = extract_qkv(llama, ids, rope="post")
    with torch.no_grad():
        att = llama(ids, output_attentions=True).attentions  # (B, Hq, T, T) per layer
    t = ids.shape[1]
    mask = torch.ones(t, t, dtype=torch.bool).tril()
    for l in range(2):
        q, k = qkv[l]["q"], qkv[l]["k"]  # (B, H, T, d)
        k = k.repeat_interleave(2, dim=1)  # query head h reads KV head h // 2
        s = torch.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(8)
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)
        torch.testing.assert_close(p, att[l], rtol=1e-5, atol=1e-6)
    # pre-RoPE keys, rotated by hand, are the post-RoPE keys; the Grams of the two modes differ
    pre = extract_qkv(llama, ids, rope="pre")
    cos, sin = llama.model.rotary_emb(pre[0]["k"], torch.arange(t)[None])
    _, k_rot = modeling_llama.apply_rotary_pos_emb(pre[0]["q"], pre[0]["k"], cos, sin)
    torch.testing.assert_close(k_rot, qkv[0]["k"], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(pre[0]["k"], qkv[0]["k"], atol=1e-3)
    torch.testing.assert_close(pre[0]["v"], qkv[0]["v"])


def test_pre_and_post_rope_stats_differ_only_in_q_k(llama, batches):
    post = calibrate(llama, batches, progress=False)  # default: post
    pre = calibrate(llama, batches, rope="pre", progress=False)
    assert post.rope == "post" and pre.rope == "pre"
    assert not torch.allclose(post.kk, pre.kk, rtol=1e-3) and not torch.allclose(post.qq, pre.qq, rtol=1e-3)
    torch.testing.assert_close(post.vv, pre.vv)
    torch.testing.assert_close(post.wo, pre.wo)
    # RoPE rotates within 2-planes: the trace (total energy) of every Gram is unchanged
    torch.testing.assert_close(torch.diagonal(post.kk, dim1=-2, dim2=-1).sum(-1),
                               torch.diagonal(pre.kk, dim1=-2, dim2=-1).sum(-1), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="rope"):
        calibrate(llama, batches, rope="none", progress=False)


# --------------------------------------------------------------------------------------------------- GPT-2 family
def test_gpt_mha_grams_match_explicit_kqv(gpt, batches):
    stats = calibrate(gpt, batches, rope="post", progress=False)  # no RoPE: recorded as "none"
    assert stats.rope == "none" and stats.family == "gpt" and stats.group_size == 1
    want = {n: torch.zeros(2, 2, 8, 8, dtype=torch.float64) for n in ("q", "k", "v")}
    with torch.no_grad():
        for b in batches:
            tr = gpt.transformer
            x = tr.wte(b) + tr.wpe(torch.arange(b.shape[1]))
            for l, block in enumerate(tr.h):
                q, k, v = block.attn.c_attn(block.ln_1(x)).split(16, dim=-1)
                for n, z in (("q", q), ("k", k), ("v", v)):
                    want[n][l] += gram(z.view(*z.shape[:2], 2, 8).transpose(1, 2))  # (B, H, T, d)
                x = block(x)
    torch.testing.assert_close(stats.kk, want["k"], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(stats.qq, want["q"], rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(stats.qsum, want["q"], rtol=1e-6, atol=1e-8)  # MHA: the group is one head
    torch.testing.assert_close(stats.vv, want["v"], rtol=1e-6, atol=1e-8)
    w = gpt.transformer.h[1].attn.c_proj.weight.double()
    torch.testing.assert_close(stats.wo[1, 1], w[:, 8:16])


def test_hf_gpt2_matches_imported_gpt(batches):
    torch.manual_seed(3)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=61, n_positions=32, n_embd=16, n_layer=2,
                                                              n_head=2)).eval()
    ours = GPT.from_hf(hf).eval()
    a, b = calibrate(hf, batches, progress=False), calibrate(ours, batches, progress=False)
    assert a.family == "gpt2" and b.family == "gpt" and a.rope == b.rope == "none"
    for n in ("kk", "qq", "qsum", "vv", "wo"):
        torch.testing.assert_close(getattr(a, n), getattr(b, n), rtol=1e-5, atol=1e-6, msg=n)
    assert model_info(hf.transformer).family == "gpt2"


def test_unsupported_models_raise(gpt):
    mla = GPT(GPTConfig(vocab_size=61, n_layer=1, n_head=2, d_model=16, block_size=32, attention="mla",
                        d_latent=8))
    with pytest.raises(ValueError, match="attention='mha'"):
        calibrate(mla, [torch.zeros(1, 4, dtype=torch.long)], progress=False)
    with pytest.raises(ValueError, match="unsupported model Linear"):
        model_info(torch.nn.Linear(2, 2))
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=16))
    with pytest.raises(ValueError, match="model_type='bert'"):
        model_fingerprint(bert)
    with pytest.raises(ValueError, match="integer token ids"):
        calibrate(gpt, [torch.zeros(1, 4)], progress=False)


# --------------------------------------------------------------------------------------------------- memory
def test_memory_is_flat_in_the_number_of_tokens(llama):
    hooks = all_hooks(llama)
    ids = torch.randint(0, 97, (4 * 64,), generator=torch.Generator().manual_seed(4))
    one = calibrate(llama, calibration_batches(ids[:128], 32, 2), progress=False)
    two = calibrate(llama, calibration_batches(ids, 32, 2), progress=False)
    assert two.n_tokens == 2 * one.n_tokens == 256
    assert one.nbytes() == two.nbytes()
    expected = 8 * (2 * 8 * 8 * (2 + 4 + 2 + 2) + 2 * 4 * 32 * 8)  # float64 kk, qq, qsum, vv + wo
    assert two.nbytes() == expected
    assert all(t.dtype == torch.float64 for t in (two.kk, two.qq, two.qsum, two.vv, two.wo))
    # nothing holds on to activations: the tensors reachable from the stats are exactly its five tensors
    assert sorted(k for k, v in vars(two).items() if isinstance(v, torch.Tensor)) == ["kk", "qq", "qsum", "vv", "wo"]
    assert all_hooks(llama) == hooks
    # a generator of batches (streamed, no len) works and gives the same sums as the list
    gen = (b for b in calibration_batches(ids, 32, 2))
    again = calibrate(llama, gen, progress=False)
    torch.testing.assert_close(again.kk, two.kk)


def test_hooks_removed_and_mode_restored_on_error(gpt):
    gpt.train()
    hooks = all_hooks(gpt)
    with pytest.raises(IndexError):
        calibrate(gpt, [torch.full((1, 4), 10_000)], progress=False)  # out-of-vocab id fails inside the forward
    assert all_hooks(gpt) == hooks == [] and gpt.training
    gpt.eval()


# --------------------------------------------------------------------------------------------------- helpers
def test_calibration_batches():
    ids = torch.arange(1000)
    b = calibration_batches(ids, seq_len=100, batch_size=4)
    assert [tuple(x.shape) for x in b] == [(4, 100), (4, 100), (2, 100)]
    assert torch.equal(torch.cat(b).reshape(-1), ids)
    assert b[0].data_ptr() == ids.data_ptr()  # views, no copy
    b = calibration_batches(ids, seq_len=100, batch_size=4, max_tokens=550)
    assert sum(x.numel() for x in b) == 500
    with pytest.raises(ValueError):
        calibration_batches(ids[:50], seq_len=100)
    with pytest.raises(ValueError):
        calibration_batches(ids.view(10, 100), seq_len=10)
    rows = list(iter_token_batches(["ab c", "defg", "hij"], lambda s: [ord(c) for c in s], seq_len=3, batch_size=2))
    assert [tuple(r.shape) for r in rows] == [(2, 3), (1, 3)]
    assert rows[0][0].tolist() == [ord("a"), ord("b"), ord(" ")]
    rows = list(iter_token_batches(["abcdefghij"], lambda s: list(s.encode()), seq_len=3, max_tokens=7))
    assert sum(r.numel() for r in rows) == 6


def test_fingerprint(llama, gpt):
    fp = model_fingerprint(llama)
    assert fp.startswith("llama-") and fp == model_fingerprint(llama)
    assert model_fingerprint(copy.deepcopy(llama).half()) == fp  # dtype cast keeps the fingerprint
    other = copy.deepcopy(llama)
    with torch.no_grad():
        other.model.layers[1].self_attn.k_proj.weight.mul_(1.5)
    assert model_fingerprint(other) != fp
    cfg2 = copy.deepcopy(llama.config)
    cfg2.rope_parameters = {"rope_type": "default", "rope_theta": 500.0}
    other2 = transformers.LlamaForCausalLM(cfg2)
    other2.load_state_dict(llama.state_dict())
    assert model_fingerprint(other2) != fp  # different RoPE, same weights
    assert model_fingerprint(gpt).startswith("gpt-")


def test_stats_save_load_roundtrip(llama, batches, tmp_path):
    stats = calibrate(llama, batches, progress=False)
    assert stats.fingerprint == model_fingerprint(llama)
    back = CalibrationStats.load(stats.save(tmp_path / "stats.safetensors"))
    for n in ("kk", "qq", "qsum", "vv", "wo"):
        assert torch.equal(getattr(back, n), getattr(stats, n))
    assert (back.n_tokens, back.rope, back.family, back.n_head, back.n_kv_head, back.head_dim, back.fingerprint) \
        == (stats.n_tokens, stats.rope, stats.family, 4, 2, 8, stats.fingerprint)


# --------------------------------------------------------------------------------------------------- stories260K
def _stories_model(tmp_path_factory):
    if not (STORIES / "stories260K.bin").is_file() or not VAL_TXT.is_file():
        pytest.skip(f"stories260K / TinyStories reference data not found under {DATA}")
    try:
        from kvsplice.convert.llama2c import convert_llama2c
    except Exception as e:  # pragma: no cover - the converter is developed in parallel
        pytest.skip(f"kvsplice.convert_llama2c is not importable: {e}")
    out = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("s260k"))
    model = transformers.LlamaForCausalLM.from_pretrained(out).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    return model, tok


@pytest.fixture(scope="module")
def stories(tmp_path_factory):
    model, tok = _stories_model(tmp_path_factory)
    text = VAL_TXT.read_text(encoding="utf-8")[:40_000]
    ids = torch.tensor(tok(text)["input_ids"], dtype=torch.long)
    return model, calibrate(model, calibration_batches(ids, seq_len=256, batch_size=8, max_tokens=8192),
                            progress=False)


def test_stories260k_attention_aware_beats_k_only(stories):
    """On a real pretrained GQA + RoPE model, every layer and KV head: attention-aware score error ≤ K-only's,
    and each GQA closed form is best on its own objective."""
    from kvsplice.lowrank.fit_errors import lesens_gaps, score_error
    from kvsplice.lowrank.fits import fit_bases

    model, stats = stories
    assert (stats.n_layer, stats.n_head, stats.n_kv_head, stats.head_dim) == (5, 8, 4, 8)
    assert stats.rope == "post" and stats.n_tokens == 8192
    for r in (2, 4, 6):
        fits = {m: fit_bases(stats, m, rank=r, dtype=torch.float64) for m in ("ksvd", "eigen", "gqa-sum",
                                                                            "gqa-concat")}
        for l in range(5):
            for j in range(4):
                kk = stats.key_gram(l, j, True)
                for gqa, best in (("concat", "gqa-concat"), ("sum", "gqa-sum")):
                    qq = stats.query_gram(l, j, gqa, True)
                    err = {m: score_error(kk, qq, b.layers[l][j].k_enc, b.layers[l][j].k_dec)
                           for m, b in fits.items()}
                    assert err[best] <= err["ksvd"] + 1e-9, (r, l, j, gqa, err)
                    assert err[best] <= min(err.values()) + 1e-9, (r, l, j, gqa, err)
        assert all(g >= 0 for row in lesens_gaps(stats, r) for g in row)
