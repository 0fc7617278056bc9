"""``python -m training.export``: MHA → GPT2LMHeadModel, MLA / KVSplice / grouped-query → a trust_remote_code
directory; logits within 1e-5 (fp32) of models.GPT, generate() == GPT.generate, cache bytes == the package's
formula, left padding, the run's tokenizer, one-line errors."""

from __future__ import annotations


import pytest
import torch
import transformers

from models import GPT
from models.config import GPTConfig
from kvsplice.report.memory import cache_bytes_formula
from models.checkpoint import save_model
from tiny_models import sharpen
from training import export as ex

V = 97
BASE = dict(vocab_size=V, n_layer=2, n_head=4, d_model=32, block_size=64, d_latent=16)
VARIANTS = {
    "mla": dict(attention="mla"),
    "kvsplice": dict(attention="mla", kvsplice_ratio=0.25),
    "kvsplice-orthogonal-nobias": dict(attention="mla", kvsplice_ratio=0.5, kvsplice_orthogonal=True, bias=False),
    "kvsplice-latent-norm": dict(attention="mla", kvsplice_ratio=0.25, latent_norm=True),
    "gqa": dict(attention="mha", n_kv_head=2),
    "mqa": dict(attention="mha", n_kv_head=1),
}


def make_ckpt(tmp_path, data_hparams=None, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**BASE, **kw})
    model = sharpen(GPT(cfg), std=0.2, seed=seed)
    path = save_model(model, tmp_path / f"model-{seed}.ckpt", data_hparams=data_hparams)
    return path, model, cfg


def ids(b=2, t=11, seed=1):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def load_remote(out):
    return transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()


# ------------------------------------------------------------------------------------------------- MHA
@pytest.mark.parametrize("bias", [True, False])
def test_mha_exports_a_plain_gpt2_with_equal_logits(tmp_path, bias):
    ckpt, model, cfg = make_ckpt(tmp_path, bias=bias)
    summary = ex.export(ckpt, tmp_path / "out", tokenizer=False)
    assert summary["kind"] == "GPT2LMHeadModel"
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-5, rtol=0)
        out = hf.generate(x[:1], max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(out, model.generate(x[:1], 10, temperature=0.0))
    assert (tmp_path / "out" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------- MLA / KVSplice / GQA
@pytest.mark.parametrize("variant", VARIANTS)
def test_remote_code_export_logits_generate_and_cache_bytes(tmp_path, variant):
    ckpt, model, cfg = make_ckpt(tmp_path, **VARIANTS[variant])
    summary = ex.export(ckpt, tmp_path / "out", tokenizer=False)
    assert summary["kind"] == "remote-code"
    assert {"configuration_kvsplice_gpt.py", "modeling_kvsplice_gpt.py", "config.json"} <= set(summary["files"])
    hf = load_remote(tmp_path / "out")
    assert type(hf).__name__ == "KVSpliceGPTForCausalLM"
    x = ids()
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(hf(x, use_cache=False).logits, ref, atol=1e-5, rtol=0)  # full forward
        cache = hf.new_cache()  # cached: prefill 7 tokens absorbed, then one token at a time
        got = [hf(x[:, :7], past_key_values=cache).logits]
        got += [hf(x[:, i:i + 1], past_key_values=cache).logits for i in range(7, x.shape[1])]
        torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-5, rtol=0)
        n = 12
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(x, n, temperature=0.0))
    t = x.shape[1] + n - 1  # tokens cached: the prompt + the generated tokens fed back
    c = out.past_key_values
    want = cache_bytes_formula(cfg, t, "fp32", batch_size=x.shape[0])
    assert c.nbytes() == want == x.shape[0] * t * cfg.n_layer * cfg.cache_dim * 4
    if cfg.attention == "mla":
        assert all(s.shape == (x.shape[0], t, cfg.cache_dim) for s in c.tensors())  # only the (compressed) latent


def test_remote_left_padding_equals_one_at_a_time(tmp_path):
    ckpt, model, cfg = make_ckpt(tmp_path, **VARIANTS["kvsplice"])
    ex.export(ckpt, tmp_path / "out", tokenizer=False)
    hf = load_remote(tmp_path / "out")
    seqs = [ids(1, t, seed=t)[0] for t in (9, 4, 6)]
    T = max(len(s) for s in seqs)
    x = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, s in enumerate(seqs):
        x[i, T - len(s):], mask[i, T - len(s):] = s, 1
    with torch.no_grad():
        batched = hf.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        for i, s in enumerate(seqs):
            alone = hf.generate(s[None], attention_mask=torch.ones_like(s[None]), max_new_tokens=8,
                                do_sample=False, pad_token_id=0)
            assert torch.equal(batched[i, T:], alone[0, len(s):]), i
            assert torch.equal(alone, model.generate(s[None], 8, temperature=0.0))


# ---------------------------------------------------------------------------------- tokenizer and errors
def test_the_runs_tokenizer_is_exported(tmp_path):
    from data import TinyStoriesDataModule

    hp = dict(synthetic=True, synthetic_stories=300, synthetic_vocab_size=300, cache_dir=str(tmp_path / "cache"))
    tok = TinyStoriesDataModule(**hp).tokenizer
    ckpt, model, cfg = make_ckpt(tmp_path, data_hparams=hp, attention="mla", vocab_size=tok.vocab_size)
    ex.export(ckpt, tmp_path / "out")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "Once upon a time there was a dog."
    assert hf_tok(text, add_special_tokens=False).input_ids == tok.encode(text)
    assert hf_tok.eos_token_id == tok.eot_id
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == tok.eot_id


def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys):
    ckpt, _, _ = make_ckpt(tmp_path, attention="mla")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("keep")
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    cases = {"non-empty out": ["--ckpt", ckpt, "--out", busy], "missing ckpt": ["--ckpt", tmp_path / "no.ckpt",
             "--out", tmp_path / "o1"], "corrupt ckpt": ["--ckpt", junk, "--out", tmp_path / "o2"],
             "missing option": ["--ckpt", ckpt], "out is a file": ["--ckpt", ckpt, "--out", junk]}
    for name, argv in cases.items():
        rc = ex.main([str(a) for a in argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("python -m training.export: error: "), (name, err)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    # --force replaces an earlier export only, never a folder holding other files
    assert ex.main(["--ckpt", str(ckpt), "--out", str(busy), "--force", "--no-tokenizer"]) == 2
    assert "holds files export does not write (keep.txt)" in capsys.readouterr().err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
