"""Tests for kvsplice.convert_llama2c on the real llama2.c stories260K checkpoint (../shared/data/stories260K).

The checks are real computations: an independent plain-torch forward pass straight from the .bin bytes (llama2.c
semantics: interleaved RoPE pairs, GQA, SwiGLU, RMSNorm), a pure-Python port of run.c's BPE encoder, and the model's
known greedy sample.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kvsplice.convert.llama2c import (
    Llama2cFormatError,
    convert_llama2c,
    read_llama2c,
    read_llama2c_tokenizer,
)
from kvsplice.cli.convert_llama2c import main

REPO = Path(__file__).resolve().parents[3]
DATA = REPO.parent / "shared" / "data"
STORIES = DATA / "stories260K"
MODEL_BIN = STORIES / "stories260K.bin"
TOK_BIN = STORIES / "tok512.bin"
VAL_TXT = DATA / "tinystories" / "yuninxia_moe-routing-bench__tinystories_val.txt"
KNOWN_SAMPLE = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park.")

pytestmark = pytest.mark.skipif(
    not (MODEL_BIN.is_file() and TOK_BIN.is_file()),
    reason=f"llama2.c stories260K reference data not found under {STORIES} (shared data folder absent)",
)


# ---------------------------------------------------------------------------------------------------------------
# independent reference: parse the legacy .bin with struct/numpy and run llama2.c's forward pass in plain torch

LEGACY_ORDER = ["tok_embeddings", "attention_norm", "wq", "wk", "wv", "wo", "ffn_norm", "w1", "w2", "w3", "norm"]


def ref_load_legacy(path: Path) -> tuple[dict, dict]:
    raw = path.read_bytes()
    dim, hidden, n_layers, n_heads, n_kv, vocab, seq_len = struct.unpack("<7i", raw[:28])
    shared = vocab > 0
    vocab = abs(vocab)
    hs = dim // n_heads
    kv_dim = hs * n_kv
    shapes = {
        "tok_embeddings": (vocab, dim), "attention_norm": (n_layers, dim), "wq": (n_layers, dim, dim),
        "wk": (n_layers, kv_dim, dim), "wv": (n_layers, kv_dim, dim), "wo": (n_layers, dim, dim),
        "ffn_norm": (n_layers, dim), "w1": (n_layers, hidden, dim), "w2": (n_layers, dim, hidden),
        "w3": (n_layers, hidden, dim), "norm": (dim,),
    }
    flat = np.frombuffer(raw, dtype="<f4", offset=28)
    w, off = {}, 0
    for k in LEGACY_ORDER:
        n = int(np.prod(shapes[k]))
        w[k] = torch.from_numpy(flat[off:off + n].copy()).reshape(shapes[k])
        off += n
    off += 2 * seq_len * hs // 2  # freqs_cos / freqs_sin
    if shared:
        w["output"] = w["tok_embeddings"]
    else:
        w["output"] = torch.from_numpy(flat[off:off + vocab * dim].copy()).reshape(vocab, dim)
        off += vocab * dim
    assert off == flat.size
    cfg = dict(dim=dim, hidden=hidden, n_layers=n_layers, n_heads=n_heads, n_kv=n_kv, vocab=vocab, seq_len=seq_len)
    return cfg, w


def _rmsnorm(x, weight, eps=1e-5):
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def _rope_interleaved(x, pos):
    """x: [T, H, hs]; rotate pairs (2j, 2j+1) by pos * 10000^(-2j/hs) with complex multiplication."""
    T, H, hs = x.shape
    freqs = 10000.0 ** (-torch.arange(0, hs, 2, dtype=torch.float64) / hs)
    ang = pos[:, None].double() * freqs[None, :]
    rot = torch.polar(torch.ones_like(ang), ang)  # [T, hs/2]
    xc = torch.view_as_complex(x.double().reshape(T, H, hs // 2, 2).contiguous())
    return torch.view_as_real(xc * rot[:, None, :]).reshape(T, H, hs)


@torch.no_grad()
def ref_forward(cfg: dict, w: dict, tokens: list[int]) -> torch.Tensor:
    """llama2.c forward pass for a whole sequence (float64 for a tight reference). Returns [T, vocab] logits."""
    W = {k: v.double() for k, v in w.items()}
    T = len(tokens)
    H, Hkv = cfg["n_heads"], cfg["n_kv"]
    hs = cfg["dim"] // H
    pos = torch.arange(T)
    x = W["tok_embeddings"][torch.tensor(tokens)]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for l in range(cfg["n_layers"]):
        h = _rmsnorm(x, W["attention_norm"][l])
        q = (h @ W["wq"][l].T).reshape(T, H, hs)
        k = (h @ W["wk"][l].T).reshape(T, Hkv, hs)
        v = (h @ W["wv"][l].T).reshape(T, Hkv, hs)
        q, k = _rope_interleaved(q, pos), _rope_interleaved(k, pos)
        heads = []
        for hh in range(H):
            kv = hh // (H // Hkv)  # grouped-query: consecutive q heads share a kv head
            att = (q[:, hh] @ k[:, kv].T) / math.sqrt(hs)
            att = att.masked_fill(~causal, float("-inf")).softmax(-1)
            heads.append(att @ v[:, kv])
        x = x + torch.cat(heads, -1) @ W["wo"][l].T
        h = _rmsnorm(x, W["ffn_norm"][l])
        x = x + (torch.nn.functional.silu(h @ W["w1"][l].T) * (h @ W["w3"][l].T)) @ W["w2"][l].T
    x = _rmsnorm(x, W["norm"])
    return x @ W["output"].T


# ---------------------------------------------------------------------------------------------------------------
# independent run.c tokenizer (encode / decode) straight from tok512.bin


def ref_load_tokenizer(path: Path) -> tuple[list[bytes], list[float]]:
    raw = path.read_bytes()
    off, pieces, scores = 4, [], []
    while off < len(raw):
        s, n = struct.unpack_from("<fi", raw, off)
        off += 8
        pieces.append(raw[off:off + n])
        scores.append(s)
        off += n
    return pieces, scores


def runc_encode(text: str, pieces: list[bytes], scores: list[float]) -> list[int]:
    """Port of llama2.c run.c encode(): dummy prefix, codepoint lookup / byte fallback, best-score pair merges."""
    vocab = {p: i for i, p in enumerate(pieces)}
    toks = [vocab[b" "]] if text else []
    for ch in text:
        b = ch.encode("utf-8")
        if b in vocab:
            toks.append(vocab[b])
        else:
            toks.extend(byte + 3 for byte in b)
    while True:
        best, best_i, best_id = -1e10, -1, -1
        for i in range(len(toks) - 1):
            tid = vocab.get(pieces[toks[i]] + pieces[toks[i + 1]])
            if tid is not None and scores[tid] > best:
                best, best_i, best_id = scores[tid], i, tid
        if best_i < 0:
            return toks
        toks[best_i:best_i + 2] = [best_id]


def runc_decode(tokens: list[int], pieces: list[bytes]) -> str:
    out, prev = b"", 1
    for t in tokens:
        p = pieces[t]
        if prev == 1 and p.startswith(b" "):
            p = p[1:]
        if p.startswith(b"<0x") and len(p) == 6:
            p = bytes([int(p[3:5], 16)])
        out += p
        prev = t
    return out.decode("utf-8", errors="replace")


# ---------------------------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="module")
def ref():
    return ref_load_legacy(MODEL_BIN)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conv") / "stories260K-hf"
    assert convert_llama2c(MODEL_BIN, TOK_BIN, out) == out
    return out


@pytest.fixture(scope="module")
def hf_model(converted):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tok(converted):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(converted)


@pytest.fixture(scope="module")
def tok_ref():
    return ref_load_tokenizer(TOK_BIN)


def _val_texts(n: int) -> list[str]:
    if not VAL_TXT.is_file():
        pytest.skip(f"TinyStories validation text not found at {VAL_TXT}")
    blocks = [b.strip() for b in VAL_TXT.read_text(encoding="utf-8").split("\n\n") if b.strip()]
    return blocks[:n]


def _hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].double()


# ---------------------------------------------------------------------------------------------------------------
# model tests


def test_reference_forward_reproduces_known_sample(ref, tok_ref):
    """Sanity of the test's own reference: greedy decoding with it gives the model's published sample."""
    cfg, w = ref
    toks = [1]
    for _ in range(30):
        toks.append(int(ref_forward(cfg, w, toks)[-1].argmax()))
    text = runc_decode(toks[1:], tok_ref[0])
    assert text.startswith("Once upon a time, there was a little girl named Lily."), text


def test_read_llama2c_header_and_tensors(ref):
    cfg, sd = read_llama2c(MODEL_BIN)
    assert {k: cfg[k] for k in ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "max_seq_len")} \
        == dict(dim=64, hidden_dim=172, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512, max_seq_len=512)
    assert cfg["shared_classifier"] is True and cfg["version"] == 0
    _, w = ref
    assert sd["tok_embeddings.weight"].shape == (512, 64)
    assert sd["layers.3.attention.wk.weight"].shape == (32, 64)
    assert sd["layers.4.feed_forward.w2.weight"].shape == (64, 172)
    assert torch.equal(sd["layers.2.attention.wq.weight"], w["wq"][2])
    assert torch.equal(sd["layers.4.feed_forward.w3.weight"], w["w3"][4])
    assert torch.equal(sd["norm.weight"], w["norm"])
    assert torch.equal(sd["output.weight"], sd["tok_embeddings.weight"])
    assert all(v.dtype == torch.float32 for v in sd.values())


def test_hf_config(converted):
    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (64, 172, 5)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (8, 4, 8)
    assert (cfg["vocab_size"], cfg["max_position_embeddings"]) == (512, 512)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["hidden_act"] == "silu" and not cfg["attention_bias"] and not cfg["mlp_bias"]
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0
    assert cfg["rope_parameters"]["rope_type"] == "default"
    assert (converted / "model.safetensors").is_file()


def test_hf_weights_tied_and_param_count(hf_model):
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    n = sum(p.numel() for p in hf_model.parameters())  # parameters() de-duplicates tied weights
    assert n == 512 * 64 + 5 * (2 * 64 + 64 * 64 * 2 + 2 * 32 * 64 + 3 * 172 * 64) + 64 == 260032


@pytest.mark.parametrize("seq", [
    [1],
    [1, 403, 407, 261, 378, 432, 383, 286, 261, 376],
    "random40",
    "random200",
])
def test_logits_match_reference(ref, hf_model, seq):
    cfg, w = ref
    if isinstance(seq, str):
        g = torch.Generator().manual_seed(len(seq))
        seq = [1] + torch.randint(3, 512, (int(seq[6:]) - 1,), generator=g).tolist()
    expected = ref_forward(cfg, w, seq)
    got = _hf_logits(hf_model, seq)
    assert got.shape == expected.shape
    err = (got - expected).abs().max().item()
    assert err < 1e-4, f"max |logit diff| = {err}"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_hf_incremental_decoding_matches_reference(ref, hf_model):
    """KV-cache path (one token at a time) gives the same logits as the reference full-sequence pass."""
    cfg, w = ref
    seq = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315]
    expected = ref_forward(cfg, w, seq)
    with torch.no_grad():
        out = hf_model(torch.tensor([seq[:5]]), use_cache=True)
        past, rows = out.past_key_values, [out.logits[0]]
        for t in seq[5:]:
            out = hf_model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            rows.append(out.logits[0])
    got = torch.cat(rows).double()
    assert (got - expected).abs().max().item() < 1e-4


def test_greedy_generation_known_sample(hf_model, hf_tok):
    out = hf_model.generate(torch.tensor([[1]]), max_new_tokens=40, do_sample=False, pad_token_id=2)
    text = hf_tok.decode(out[0], skip_special_tokens=True)
    assert text.startswith(KNOWN_SAMPLE), text


# ---------------------------------------------------------------------------------------------------------------
# tokenizer tests


def test_tokenizer_vocab_and_specials(hf_tok, tok_ref):
    pieces, _ = tok_ref
    assert len(hf_tok) == 512
    assert (hf_tok.unk_token_id, hf_tok.bos_token_id, hf_tok.eos_token_id) == (0, 1, 2)
    assert hf_tok.convert_ids_to_tokens([0, 1, 2, 3, 13, 258]) == ["<unk>", "<s>", "</s>", "<0x00>", "<0x0A>", "<0xFF>"]
    for i in range(3, 512):  # every non-special piece maps 1:1, with "▁" for spaces
        assert hf_tok.convert_ids_to_tokens(i) == pieces[i].decode("utf-8").replace(" ", "▁")


def test_tokenizer_simple_sentence(hf_tok, tok_ref):
    ids = hf_tok("Once upon a time, there was a little girl named Lily.").input_ids
    toks = hf_tok.convert_ids_to_tokens(ids)
    assert ids[0] == 1  # BOS prepended like run.c / Llama
    assert toks[1:7] == ["▁Once", "▁upon", "▁a", "▁time", ",", "▁there"]
    assert all(t.startswith("▁") or not t.startswith(" ") for t in toks)
    assert ids[1:] == runc_encode("Once upon a time, there was a little girl named Lily.", *tok_ref)
    assert hf_tok.encode("Lily", add_special_tokens=False) == runc_encode("Lily", *tok_ref)


@pytest.mark.parametrize("text", [
    "Tom said, \"Let's go!\" 123 — café ™ 日本\n\tend  two  spaces",
    " leading space",
    "a",
    "",
])
def test_tokenizer_matches_runc_on_edge_cases(hf_tok, tok_ref, text):
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert ids == runc_encode(text, *tok_ref)
    assert hf_tok.decode(ids) == text


def test_tokenizer_matches_runc_and_round_trips_on_tinystories(hf_tok, tok_ref):
    texts = _val_texts(12)
    for text in texts:
        ids = hf_tok.encode(text, add_special_tokens=False)
        assert ids == runc_encode(text, *tok_ref), text[:80]
        assert hf_tok.decode(ids) == text
        assert hf_tok.decode([1] + ids, skip_special_tokens=True) == text
        assert runc_decode(ids, tok_ref[0]) == text


# ---------------------------------------------------------------------------------------------------------------
# other llama2.c formats (v1 fp32, v2 Q8_0, untied legacy), written here following llama2.c export.py


def _header_v12(version: int, cfg: dict, shared: bool, group_size: int | None = None) -> bytes:
    h = struct.pack("<Ii", 0x616B3432, version)
    h += struct.pack("<7i", cfg["dim"], cfg["hidden"], cfg["n_layers"], cfg["n_heads"], cfg["n_kv"], cfg["vocab"],
                     cfg["seq_len"])
    h += struct.pack("<B", int(shared))
    if group_size is not None:
        h += struct.pack("<i", group_size)
    return h + b"\0" * (256 - len(h))


def _f32(t: torch.Tensor) -> bytes:
    return t.detach().float().contiguous().numpy().astype("<f4").tobytes()


def _write_v1(path: Path, cfg: dict, w: dict) -> None:
    body = [w["attention_norm"], w["ffn_norm"], w["norm"], w["tok_embeddings"],
            w["wq"], w["wk"], w["wv"], w["wo"], w["w1"], w["w2"], w["w3"]]
    path.write_bytes(_header_v12(1, cfg, True) + b"".join(_f32(t) for t in body))


def _q80(t: torch.Tensor, gs: int):
    x = t.float().reshape(-1, gs)
    scale = x.abs().max(dim=1).values / 127.0
    q = torch.round(x / scale[:, None]).to(torch.int8)
    return q, scale, (q.float() * scale[:, None]).reshape(t.shape)


def _write_v2(path: Path, cfg: dict, w: dict, gs: int = 64) -> dict:
    out = _header_v12(2, cfg, True, gs) + _f32(w["attention_norm"]) + _f32(w["ffn_norm"]) + _f32(w["norm"])
    deq = {}
    tensors = [("tok_embeddings", None)] + [(k, l) for k in ("wq", "wk", "wv", "wo", "w1", "w2", "w3")
                                            for l in range(cfg["n_layers"])]
    for k, l in tensors:
        t = w[k] if l is None else w[k][l]
        q, s, d = _q80(t, gs)
        out += q.numpy().tobytes() + _f32(s)  # int8 values then that tensor's scales (runq.c layout)
        deq[(k, l)] = d
    path.write_bytes(out)
    return deq


def test_read_v1_matches_legacy(tmp_path, ref):
    cfg, w = ref
    p = tmp_path / "v1.bin"
    _write_v1(p, cfg, w)
    c0, sd0 = read_llama2c(MODEL_BIN)
    c1, sd1 = read_llama2c(p)
    assert c1["version"] == 1 and c1["shared_classifier"]
    assert {k: v for k, v in c1.items() if k != "version"} == {k: v for k, v in c0.items() if k != "version"}
    assert sd1.keys() == sd0.keys()
    assert all(torch.equal(sd1[k], sd0[k]) for k in sd0)


def test_read_v2_q80_dequantizes(tmp_path, ref):
    cfg, w = ref
    p = tmp_path / "v2.bin"
    deq = _write_v2(p, cfg, w, gs=64)
    c2, sd2 = read_llama2c(p)
    assert c2["version"] == 2 and c2["group_size"] == 64
    assert torch.allclose(sd2["tok_embeddings.weight"], deq[("tok_embeddings", None)], atol=1e-7, rtol=0)
    assert torch.allclose(sd2["layers.3.attention.wk.weight"], deq[("wk", 3)], atol=1e-7, rtol=0)
    assert torch.allclose(sd2["layers.4.feed_forward.w2.weight"], deq[("w2", 4)], atol=1e-7, rtol=0)
    assert torch.equal(sd2["layers.1.ffn_norm.weight"], w["ffn_norm"][1])  # norms stay fp32
    # quantization error is bounded by half a step of each group
    err = (sd2["layers.0.feed_forward.w1.weight"] - w["w1"][0]).abs().max()
    assert 0 < err <= w["w1"][0].abs().max() / 127 / 2 + 1e-6


def test_untied_legacy_checkpoint_converts(tmp_path, ref):
    """vocab_size < 0 in a legacy header: separate classifier at the end of the file -> untied lm_head."""
    from transformers import LlamaForCausalLM

    cfg, w = ref
    raw = bytearray(MODEL_BIN.read_bytes())
    raw[20:24] = struct.pack("<i", -cfg["vocab"])
    g = torch.Generator().manual_seed(0)
    output = w["tok_embeddings"] * 0.5 + 0.05 * torch.randn(w["tok_embeddings"].shape, generator=g)
    p = tmp_path / "untied.bin"
    p.write_bytes(bytes(raw) + _f32(output))
    rcfg, rw = ref_load_legacy(p)
    assert torch.equal(rw["output"], output)

    out = convert_llama2c(p, None, tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer.json").exists()
    model = LlamaForCausalLM.from_pretrained(out).eval()
    assert model.config.tie_word_embeddings is False
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    seq = [1, 403, 407, 261, 378, 432, 383]
    err = (_hf_logits(model, seq) - ref_forward(rcfg, rw, seq)).abs().max().item()
    assert err < 1e-4


# ---------------------------------------------------------------------------------------------------------------
# CLI and error handling


def test_cli_main_summary(tmp_path, capsys):
    out = tmp_path / "out"
    assert main([str(MODEL_BIN), "--tokenizer", str(TOK_BIN), "--out", str(out)]) == 0
    msg = capsys.readouterr().out
    assert "260,032 params" in msg and "5 layers" in msg and "8 heads" in msg and "4 kv heads" in msg
    assert str(out) in msg
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        f.name for f in out.iterdir()}


def _expect_error(argv, *fragments):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(argv)
    line = err.getvalue().strip()
    assert rc == 2 and "\n" not in line and line.startswith("kvsplice convert-llama2c: error: "), (rc, line)
    for f in fragments:
        assert f in line, line
    return line


def test_error_truncated_model(tmp_path):
    bad = tmp_path / "trunc.bin"
    bad.write_bytes(MODEL_BIN.read_bytes()[:-100])
    out = tmp_path / "out"
    _expect_error([str(bad), "--tokenizer", str(TOK_BIN), "--out", str(out)], "truncated", "1056540")
    assert not out.exists()
    with pytest.raises(Llama2cFormatError):
        read_llama2c(bad)


def test_error_trailing_bytes_and_tiny_file(tmp_path):
    bad = tmp_path / "long.bin"
    bad.write_bytes(MODEL_BIN.read_bytes() + b"\0" * 8)
    _expect_error([str(bad), "--out", str(tmp_path / "o1")], "does not match")
    tiny = tmp_path / "tiny.bin"
    tiny.write_bytes(b"\1\2\3")
    _expect_error([str(tiny), "--out", str(tmp_path / "o2")], "too short")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_error_bad_header_and_unknown_version(tmp_path):
    raw = bytearray(MODEL_BIN.read_bytes())
    raw[12:16] = struct.pack("<i", 7)  # n_heads=7 does not divide dim=64
    bad = tmp_path / "hdr.bin"
    bad.write_bytes(bytes(raw))
    _expect_error([str(bad), "--out", str(tmp_path / "o1")], "header")
    v9 = tmp_path / "v9.bin"
    v9.write_bytes(struct.pack("<Ii", 0x616B3432, 9) + b"\0" * 300)
    _expect_error([str(v9), "--out", str(tmp_path / "o2")], "unsupported llama2.c format version 9")


def test_error_missing_files(tmp_path):
    _expect_error([str(tmp_path / "nope.bin"), "--out", str(tmp_path / "o")], "nope.bin")
    _expect_error([str(MODEL_BIN), "--tokenizer", str(tmp_path / "nope_tok.bin"), "--out", str(tmp_path / "o")],
                  "nope_tok.bin")
    assert not (tmp_path / "o").exists()


def test_error_truncated_tokenizer(tmp_path):
    bad = tmp_path / "tok.bin"
    bad.write_bytes(TOK_BIN.read_bytes()[:-3])
    _expect_error([str(MODEL_BIN), "--tokenizer", str(bad), "--out", str(tmp_path / "o")], "tokenizer")
    assert not (tmp_path / "o").exists()
    with pytest.raises(Llama2cFormatError):
        read_llama2c_tokenizer(bad)


def test_error_nonempty_out_dir_and_force(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    _expect_error([str(MODEL_BIN), "--tokenizer", str(TOK_BIN), "--out", str(out)], "not empty", "--force")
    assert sorted(f.name for f in out.iterdir()) == ["keep.txt"]
    assert main([str(MODEL_BIN), "--tokenizer", str(TOK_BIN), "--out", str(out), "--force"]) == 0
    assert (out / "keep.txt").read_text() == "x" and (out / "model.safetensors").is_file()
    # an existing *empty* directory is fine without --force
    empty = tmp_path / "empty"
    empty.mkdir()
    assert convert_llama2c(MODEL_BIN, TOK_BIN, empty) == empty


def test_cli_subprocess_truncated_exit_code(tmp_path):
    bad = tmp_path / "trunc.bin"
    bad.write_bytes(MODEL_BIN.read_bytes()[:1000])
    r = subprocess.run([sys.executable, "-m", "kvsplice.cli.convert_llama2c", str(bad), "--tokenizer", str(TOK_BIN),
                        "--out", str(tmp_path / "o")], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 2
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvsplice convert-llama2c: error:") and "truncated" in last
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists()
