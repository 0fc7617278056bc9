"""The trained family: ``python -m training.fit --config tiny_ds_mla_kvsplice_90``
trains (a short real run), and ``kvsplice export --format deepseek_v3 | llama`` writes folders plain
``transformers`` loads without remote code, whose logits equal our model's (fp32, ≤ 1e-4) and whose greedy tokens
(transformers' own cache) equal ours; KVSplice-r is written as ``kv_lora_rank = r``.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from models import GPT
from models.checkpoint import save_model
from models.config import GPTConfig
from tiny_models import sharpen
from training import export as ex
from training.checkpoint import load_gpt_checkpoint
from training.fit import main as fit

V = 97
BASE = dict(vocab_size=V, n_layer=2, n_head=4, d_model=32, block_size=64, d_latent=16, bias=False,
            layout="deepseek_v3", d_ff=88)
VARIANTS = {  # name -> (config fields, transformers class)
    "mha": (dict(attention="mha", rope_theta=5e5), "LlamaForCausalLM"),
    "gqa": (dict(attention="mha", n_kv_head=2), "LlamaForCausalLM"),
    "mla": (dict(attention="mla", qk_rope_head_dim=8, latent_norm=True, rope_theta=5e5), "DeepseekV3ForCausalLM"),
    "kvsplice": (dict(attention="mla", qk_rope_head_dim=8, kvsplice_keep=0.25, kvsplice_norm=True),
                 "DeepseekV3ForCausalLM"),
    "kvsplice-orthogonal-untied": (dict(attention="mla", qk_rope_head_dim=4, kvsplice_keep=0.5, kvsplice_norm=True,
                                        kvsplice_orthogonal=True, tie_embeddings=False), "DeepseekV3ForCausalLM"),
}


def ids_of(b: int = 2, t: int = 21, seed: int = 1, vocab: int = V) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def load_plain(folder):
    """transformers' own class for the folder, no remote code."""
    return transformers.AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False).eval()


def check_same(hf, model: GPT, vocab: int) -> float:
    """Logits within 1e-4 and the same greedy 16 tokens (transformers decodes through its own cache)."""
    ids = ids_of(vocab=vocab)
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    diff = (ours - theirs).abs().max().item()
    assert diff <= 1e-4, diff
    prompt = ids[:1, :5]
    want = model.generate(prompt, 16, temperature=0)
    got = hf.generate(prompt, max_new_tokens=16, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    return diff


@pytest.mark.parametrize("name", VARIANTS)
def test_export_loads_in_plain_transformers_with_our_logits(tmp_path, name):
    fields, hf_class = VARIANTS[name]
    torch.manual_seed(0)
    model = sharpen(GPT(GPTConfig(**{**BASE, **fields})), std=0.25)
    ckpt = save_model(model, tmp_path / "model.ckpt")
    summary = ex.export(ckpt, tmp_path / "out", fmt="auto")
    assert summary["kind"] == hf_class
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "auto_map" not in config and config["architectures"] == [hf_class]
    hf = load_plain(tmp_path / "out")
    assert type(hf).__name__ == hf_class
    if model.cfg.attention == "mla":
        assert config["kv_lora_rank"] == model.cfg.d_cached_latent  # KVSplice-r: r
        assert config["q_lora_rank"] is None and config["rms_norm_eps"] == 1e-6
        assert hf.model.layers[0].self_attn.kv_a_layernorm.variance_epsilon == config["rms_norm_eps"]
    check_same(hf, model, V)


def test_a_format_the_model_cannot_take_is_one_line(tmp_path, capsys):
    torch.manual_seed(0)
    mla = GPT(GPTConfig(**BASE, **VARIANTS["mla"][0]))
    gpt2 = GPT(GPTConfig(vocab_size=V, n_layer=1, n_head=2, d_model=16, block_size=16, d_latent=8))
    for model, fmt, want in ((mla, "llama", "deepseek_v3"), (gpt2, "deepseek_v3", "gpt2")):
        ckpt = save_model(model, tmp_path / f"{fmt}.ckpt")
        rc = ex.main(["--ckpt", str(ckpt), "--out", str(tmp_path / fmt), "--format", fmt])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1, err
        assert f"--format {fmt} cannot express" in err and f"use --format {want}" in err
        assert not (tmp_path / fmt / "config.json").exists()


def test_tiny_ds_kvsplice_90_trains_and_its_export_equals_it(tmp_path, data_cache, offline, capsys):
    """A short real run of the CPU config (its shapes; fewer steps, a smaller synthetic vocabulary), then the export
    of its checkpoint through the command line."""
    rc = fit(["--config", "tiny_ds_mla_kvsplice_90", "--trainer.max_steps", "8", "--trainer.val_check_interval", "8",
              "--data.synthetic_stories", "2000", "--data.synthetic_vocab_size", "512", "--data.batch_size", "8",
              "--data.val_batches", "2", "--data.cache_dir", str(data_cache), "--runs_dir", str(tmp_path),
              "--wandb.mode", "disabled", "--trainer.enable_progress_bar", "false"])
    assert rc == 0, capsys.readouterr().err[-3000:]
    ckpt = tmp_path / "tiny_ds_mla_kvsplice_90" / "last.ckpt"
    model, cfg, meta = load_gpt_checkpoint(ckpt)
    assert cfg.variant == "ds_mla_kvsplice_90" and cfg.cache_dim == 6 + 8 and meta["global_step"] == 8
    first = model.transformer.h[0].attn
    assert not torch.allclose(first.splice.compress_weight() @ first.splice.expand_weight(), torch.eye(6))  # learned
    rc = ex.main(["--ckpt", str(ckpt), "--out", str(tmp_path / "export"), "--format", "deepseek_v3"])
    assert rc == 0, capsys.readouterr().err
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["kv_lora_rank"] == 6 and config["qk_rope_head_dim"] == 8
    assert (tmp_path / "export" / "tokenizer.json").is_file()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert len(tok) <= cfg.vocab_size
    check_same(load_plain(tmp_path / "export"), model, len(tok))
