"""llama.cpp's own KV cache types through :class:`kvsplice.convert.engines.llama_cpp.LlamaCppModel`.

Always run: an unknown type and a quantised V without flash attention are one-line errors before llama.cpp is touched;
ggml's block sizes give q8_0 = 34 and q4_0 = 18 bytes per 32 numbers.

With llama.cpp (marker ``engines``; skipped with a one-line reason when it is absent): a tiny random Llama written as
a GGUF by gguf-py here (no tokenizer: ``tokenizer.ggml.model = none``; its q / k weights permuted as llama.cpp's own
converter permutes them), beside the same weights in transformers. The type option reaches llama.cpp (its log names
the types), the cache it allocates per token equals ggml's closed form (and ``ggml_row_size`` of the library) for
f16, q8_0, q4_0, q4_1 and iq4_nl, f16 perplexity on protocol P's scoring equals transformers' fp32 within 0.5 %, and
q8_0 within 0.5 % of f16 while q4_0 moves further; a task instance answered through llama.cpp (both settings) gives
transformers' greedy tokens, scored by the instance.
"""

from __future__ import annotations

import ctypes
import math

import numpy as np
import pytest
import torch
import transformers

from kvsplice.convert.engines import gguf_convert, llama_cpp
from kvsplice.convert.engines.kv_types import KV_TYPES, kv_bytes_per_token, kv_type

N_LAYER, N_HEAD, N_KV, HEAD, HIDDEN, FFN, VOCAB = 2, 4, 2, 32, 128, 256, 256
CELLS = 32768  # llama.cpp reports MiB to 2 decimals: at 2^15 cells these caches are exact multiples of 0.01 MiB


def test_unknown_type_is_one_line():
    with pytest.raises(ValueError, match="unknown llama.cpp KV cache type 'q3_k_x'") as e:
        kv_type("q3_k_x")
    assert "\n" not in str(e.value) and "q8_0" in str(e.value)
    with pytest.raises(ValueError, match="unknown llama.cpp KV cache type"):
        llama_cpp.LlamaCppModel("nowhere.gguf", type_k="int8")  # refused before llama.cpp is loaded


def test_quantised_v_needs_flash_attention():
    with pytest.raises(ValueError, match="only with flash attention") as e:
        llama_cpp.LlamaCppModel("nowhere.gguf", cache_type="q4_0", flash_attn=False)
    assert "\n" not in str(e.value)


def test_block_bytes():
    assert kv_type("q8_0").row_bytes(64) == 2 * 34 and kv_type("Q4_0").row_bytes(64) == 2 * 18
    assert kv_type("q4_1").row_bytes(64) == 2 * 20 and kv_type("f16").row_bytes(64) == 128
    # SmolLM2-135M: 30 layers x 3 KV heads x 64: f16 23,040 B a token; q8_0 12,240 (1.88x smaller); q4_0 6,480
    assert kv_bytes_per_token(30, 3, 64, 64, "f16", "f16") == 23040
    assert kv_bytes_per_token(30, 3, 64, 64, "q8_0", "q8_0") == 12240
    assert kv_bytes_per_token(30, 3, 64, 64, "q4_0", "q4_0") == 6480
    with pytest.raises(ValueError, match="multiple of 32"):
        kv_type("q8_0").row_bytes(48)


# ------------------------------------------------------------------------------------------------ llama.cpp itself
def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's q / k permutation (HF's half-split RoPE pairs to ggml's adjacent pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``(gguf path, transformers model)``: one random Llama in both."""
    why = llama_cpp.missing(converter=False, bindings=True)
    if why:
        pytest.skip(why)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                                   num_hidden_layers=N_LAYER, num_attention_heads=N_HEAD, num_key_value_heads=N_KV,
                                   head_dim=HEAD, rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                   max_position_embeddings=4096, initializer_range=0.1)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    gguf = gguf_convert.gguf_module()
    path = tmp_path_factory.mktemp("kv") / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), arch="llama")
    w.add_context_length(4096)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(FFN)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV)
    w.add_rope_dimension_count(HEAD)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("none")
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.add_tensor("output.weight", sd["lm_head.weight"])
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(N_LAYER):
        for hf_name, name in names.items():
            t = sd[f"model.layers.{i}.{hf_name}.weight"]
            if name in ("attn_q", "attn_k"):
                t = _permute(t, N_HEAD if name == "attn_q" else N_KV)
            w.add_tensor(f"blk.{i}.{name}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, hf


def _hf_ppl(hf, ids: list[int], prompt_len: int) -> float:
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]
    nll = torch.nn.functional.cross_entropy(logits[prompt_len - 1:-1], torch.tensor(ids[prompt_len:]))
    return math.exp(nll.item())


@pytest.mark.engines
@pytest.mark.parametrize("kv", ["f16", "q8_0", "q4_0", "q4_1", "iq4_nl"])
def test_cache_bytes_equal_the_formula(tiny, kv):
    path, _ = tiny
    with llama_cpp.LlamaCppModel(path, n_ctx=CELLS, n_batch=64, cache_type=kv, flash_attn=True) as lm:
        c = lm.kv_cache()
        assert (c["cells"], c["layers"], c["k_type"], c["v_type"]) == (CELLS, N_LAYER, kv, kv)
        assert (lm.type_k, lm.type_v) == (kv, kv)
        assert lm.kv_bytes_per_token == kv_bytes_per_token(N_LAYER, N_KV, HEAD, HEAD, kv, kv)
    base = ctypes.CDLL(str(llama_cpp.binary("libggml-base.so")))
    base.ggml_row_size.restype, base.ggml_row_size.argtypes = ctypes.c_size_t, [ctypes.c_int, ctypes.c_int64]
    assert base.ggml_row_size(KV_TYPES[kv].ggml_id, HEAD) == kv_type(kv).row_bytes(HEAD)  # the ids are ggml's


@pytest.mark.engines
def test_k_and_v_types_apart(tiny):
    path, _ = tiny
    with llama_cpp.LlamaCppModel(path, n_ctx=CELLS, n_batch=64, type_k="q8_0", type_v="q4_0") as lm:
        c = lm.kv_cache()
        assert (c["k_type"], c["v_type"]) == ("q8_0", "q4_0")
        assert "flash_attn            = enabled" in lm.log  # turned on for the quantised V
        assert lm.kv_bytes_per_token == N_LAYER * N_KV * (34 + 18)  # one 32-block a row at head_dim 32


@pytest.mark.engines
def test_perplexity_f16_matches_transformers_and_q8_0_matches_f16(tiny):
    from benchmarks.lib.smollm2_llama_cpp import protocol_p

    path, hf = tiny
    gen = torch.Generator().manual_seed(1)
    windows = torch.randint(0, VOCAB, (2, 96), generator=gen).tolist()
    ref = math.exp(sum(math.log(_hf_ppl(hf, w, 64)) for w in windows) / 2)  # equal counts: the pooled NLL
    ppl = {}
    for kv in ("f16", "q8_0", "q4_0"):
        with llama_cpp.LlamaCppModel(path, n_ctx=256, cache_type=kv, flash_attn=True) as lm:
            r = protocol_p(lm, windows, prompt_len=64, chunk=16)
            assert r["scored_tokens"] == 2 * 32
            ppl[kv] = r["ppl"]
    assert abs(ppl["f16"] / ref - 1) <= 0.005, (ppl, ref)
    assert abs(ppl["q8_0"] / ppl["f16"] - 1) <= 0.005, ppl
    assert ppl["q8_0"] != ppl["f16"]  # the type took effect
    assert abs(ppl["q4_0"] / ppl["f16"] - 1) > abs(ppl["q8_0"] / ppl["f16"] - 1), ppl


class _CharTokenizer:
    """One id per character (the tiny model has no tokenizer): what the suite's ``prompt_ids`` / ``decode_text`` read."""

    sep, bos_id, eos_id = "none", None, None

    def __init__(self) -> None:
        self.backend = self  # decode_text reads ``tokenizer.backend.decode``

    def encode(self, text: str) -> list[int]:
        return [ord(c) % VOCAB for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


@pytest.mark.engines
def test_answer_is_the_greedy_answer_in_both_settings(tiny):
    from benchmarks.lib.smollm2_llama_cpp import answer
    from kvsplice.tasks.instance import TaskInstance

    path, hf = tiny
    tok = _CharTokenizer()
    inst = TaskInstance("passkey", 96, 0, "The pass key is 40123. Remember it. " * 2, " The pass key is",
                        ("40123",), 12)
    ids = tok.encode(inst.context) + tok.encode(inst.question)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
    with llama_cpp.LlamaCppModel(path, n_ctx=256, cache_type="f16", flash_attn=True) as lm:
        for setting in ("agnostic", "aware"):
            out = answer(lm, tok, inst, setting=setting)
            assert out["tokens"] == ref and out["n_prompt"] == len(ids) and out["setting"] == setting
            assert out["output"] == tok.decode(ref) and out["score"] == inst.score(out["output"])
        with pytest.raises(ValueError, match="exceed n_ctx"):
            answer(lm, tok, TaskInstance("passkey", 400, 0, "x" * 300, "?", ("1",), 8))
