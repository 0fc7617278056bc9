"""The ``deepseek_v3`` layout of :class:`models.GPT` (RMSNorm, SwiGLU, RoPE; Llama attention, MLA
with a decoupled RoPE key, MLA + KVSplice) through the package's own paths.

Independent paths held equal: the full forward (training graph) ≡ the cached decode, naive and absorbed, over a
prefill, single tokens and chunks; the package ``Decoder`` ≡ the model; KVSplice-r ≡ an MLA model of latent r built
from the folded weights (a separate model, not the export); measured cache bytes == the formula
(``kvsplice.verify_memory``); config checks name the field.
"""

from __future__ import annotations

import pytest
import torch

from kvsplice.decode import Decoder, DenseKV, ModelAttention
from kvsplice.cli.verify_memory import main as verify_memory
from models import GPT
from models.config import GPTConfig
from tiny_models import sharpen

V = 97
BASE = dict(vocab_size=V, n_layer=2, n_head=4, d_model=32, block_size=64, d_latent=16, bias=False,
            layout="deepseek_v3", d_ff=88, rope_theta=500.0)
VARIANTS = {
    "mha": dict(attention="mha"),
    "gqa": dict(attention="mha", n_kv_head=2),
    "mla": dict(attention="mla", qk_rope_head_dim=8, latent_norm=True),
    "kvsplice": dict(attention="mla", qk_rope_head_dim=8, kvsplice_keep=0.25, kvsplice_norm=True),
    "kvsplice-orthogonal-untied": dict(attention="mla", qk_rope_head_dim=4, kvsplice_keep=0.5, kvsplice_norm=True,
                                       kvsplice_orthogonal=True, tie_embeddings=False),
}


def model_of(name: str, **kw) -> GPT:
    torch.manual_seed(0)
    return sharpen(GPT(GPTConfig(**{**BASE, **VARIANTS[name], **kw})), std=0.25)


def ids_of(b: int = 2, t: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def cached(model: GPT, ids: torch.Tensor, cuts=(9, 10, 11, 15)) -> torch.Tensor:
    """Logits of ``ids`` through one cache: a prefill, single tokens, a chunk, the rest."""
    cache = model.new_cache(ids.shape[0])
    bounds = (0, *cuts, ids.shape[1])
    return torch.cat([model(ids[:, a:b], cache=cache) for a, b in zip(bounds, bounds[1:])], dim=1)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("impl", ["naive", "absorb"])
def test_cached_decode_naive_and_absorbed_equal_the_full_forward(name, impl):
    model = model_of(name, mla_impl=impl)
    ids = ids_of()
    with torch.no_grad():
        full = model(ids)
        assert full.std() > 1.0  # peaked: an error shows far above the tolerance
        torch.testing.assert_close(cached(model, ids), full, atol=1e-4, rtol=0)


def test_positions_matter_without_learned_positions():
    """No ``wpe``: RoPE alone tells positions apart (the same tokens in another order give other logits)."""
    model = model_of("mla", mla_impl="absorb")
    ids = ids_of(1, 12)
    with torch.no_grad():
        a = model(ids)[:, -1]
        b = model(ids.roll(1, dims=1))[:, -1]
    assert (a - b).abs().max() > 1e-2
    assert "wpe" not in model.transformer


@pytest.mark.parametrize("name", ["mha", "mla", "kvsplice"])
def test_the_package_decoder_runs_the_models_own_cache(name):
    model = model_of(name, mla_impl="absorb")
    dec = Decoder(model)
    assert isinstance(dec.method, ModelAttention)
    ids = ids_of(2, 20, 3)
    cache = dec.new_cache(2)
    with torch.no_grad():
        got = torch.cat([dec(ids[:, :12], cache), dec(ids[:, 12:13], cache), dec(ids[:, 13:], cache)], dim=1)
        torch.testing.assert_close(got, model(ids), atol=1e-4, rtol=0)
    assert torch.equal(dec.generate(ids[:1, :5], 8), model.generate(ids[:1, :5], 8, temperature=0))


def test_post_training_methods_refuse_the_rope_layout_in_one_line():
    with pytest.raises(ValueError, match="layout='deepseek_v3' \\(RoPE\\): export it with --format llama") as e:
        Decoder(model_of("mha"), DenseKV())
    assert "\n" not in str(e.value) and len(str(e.value)) <= 300


@torch.no_grad()
def test_kvsplice_r_is_an_mla_model_of_latent_r():
    """Fold compress into the down-projection and expand into the up-projections: a plain MLA model with
    ``d_latent = r`` (latent norm = KVSplice's norm on the compressed latent) computes the same logits."""
    ks = model_of("kvsplice")
    cfg = ks.cfg
    r = cfg.d_compressed
    mla_cfg = cfg.replace(d_latent=r, kvsplice_keep=None, kvsplice_norm=False, latent_norm=True)
    mla = GPT(mla_cfg).eval()
    sd = {k: v for k, v in ks.state_dict().items() if ".splice" not in k and ".kv_norm" not in k}
    for i, blk in enumerate(ks.transformer.h):
        a, pre = blk.attn, f"transformer.h.{i}.attn."
        c, e = a.splice.compress_weight(), a.splice.expand_weight()  # (r, d_latent), (d_latent, r)
        sd[pre + "w_dkv.weight"] = c @ a.w_dkv.weight  # (r, d)
        sd[pre + "w_uk.weight"], sd[pre + "w_uv.weight"] = a.w_uk.weight @ e, a.w_uv.weight @ e  # (H·hs, r)
        sd[pre + "kv_norm.weight"] = a.splice_norm.weight
    mla.load_state_dict(sd)
    ids = ids_of()
    torch.testing.assert_close(mla(ids), ks(ids), atol=1e-4, rtol=0)
    assert mla.cfg.cache_dim == ks.cfg.cache_dim == r + cfg.qk_rope_head_dim


@pytest.mark.parametrize("name", VARIANTS)
def test_cache_bytes_per_token(name):
    model = model_of(name)
    cfg = model.cfg
    cache = model.new_cache(1)
    with torch.no_grad():
        model(ids_of(1, 10), cache=cache)
    want = 2 * cfg.kv_heads * cfg.head_size if cfg.attention == "mha" else cfg.d_cached_latent + cfg.qk_rope_head_dim
    assert cache.elements_per_token() == cfg.n_layer * want
    assert cache.bytes_per_token() == cfg.n_layer * want * 4  # fp32


def test_verify_memory_measures_the_formula_for_every_ds_config(capsys):
    names = ["tiny_ds_mha", "tiny_ds_mla", "tiny_ds_mla_kvsplice_50", "tiny_ds_mla_kvsplice_90"]
    rc = verify_memory(["--config", *names, "--seq-lens", "32", "--decode-steps", "3", "--no-progress",
                        "--markdown", "--cache-quant", "int8", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 0, out
    # tiny: 4 layers x 2 bytes x (2 x 128 | 64 + 8 | 32 + 8 | 6 + 8) per token, 32 tokens
    for name, per_token in zip(names, (256, 72, 40, 14)):
        assert f"| {name} | 32 | {32 * 4 * 2 * per_token:,} |" in out


@pytest.mark.parametrize("kw,field", [
    (dict(attention="mla", qk_rope_head_dim=8, kvsplice_keep=0.25, latent_norm=True), "latent_norm"),
    (dict(attention="mla", qk_rope_head_dim=8, kvsplice_keep=0.25), "kvsplice_norm"),
    (dict(attention="mla", qk_rope_head_dim=0, latent_norm=True), "qk_rope_head_dim"),
    (dict(attention="mla", qk_rope_head_dim=8, latent_norm=True, bias=True), "bias"),
    (dict(attention="mha", qk_rope_head_dim=8), "qk_rope_head_dim"),
    (dict(attention="mha", d_ff=None), "d_ff"),
])
def test_invalid_deepseek_layouts_name_the_field(kw, field):
    with pytest.raises(ValueError, match=f"GPTConfig.{field} must be"):
        GPTConfig(**{**BASE, **kw})


def test_gpt2_layout_refuses_deepseek_fields():
    with pytest.raises(ValueError, match="GPTConfig.d_ff must be"):
        GPTConfig(vocab_size=V, d_ff=64)
    with pytest.raises(ValueError, match="GPTConfig.tie_embeddings must be"):
        GPTConfig(vocab_size=V, tie_embeddings=False)


DS_CONFIGS = {  # name -> (attention, kvsplice_keep, latent_norm, kvsplice_norm, GPT-2-layout twin)
    "ds_mha": ("mha", None, False, False, {"tiny_": "tiny_gpt2", "small_": "small_mha", "": "gpt2"}),
    "ds_mla": ("mla", None, True, False, None),
    "ds_mla_kvsplice_50": ("mla", 0.5, False, True, None),
    "ds_mla_kvsplice_90": ("mla", 0.1, False, True, None),
}
SHARED = ("learning_rate", "weight_decay", "betas", "warmup_steps", "min_lr_ratio", "n_layer", "n_head", "d_model",
          "block_size", "d_latent", "dropout")


@pytest.mark.parametrize("prefix,rope", [("tiny_", 8), ("small_", 8), ("", 16)])
def test_ds_configs_differ_only_in_attention_and_train_like_their_gpt2_twins(prefix, rope):
    import yaml

    from models.config import CONFIG_DIR

    stripped = []
    for name, (attention, ratio, latent_norm, kvsplice_norm, twins) in DS_CONFIGS.items():
        text = (CONFIG_DIR / f"{prefix}{name}.yaml").read_text()
        assert text.startswith("#") and f"python -m training.fit --config {prefix}{name}" in text
        cfg = yaml.safe_load(text)
        twin = yaml.safe_load((CONFIG_DIR / f"{twins[prefix] if twins else prefix + name[3:]}.yaml").read_text())
        for section in ("seed_everything", "trainer", "data"):
            assert cfg[section] == twin[section], (name, section)
        m = cfg["model"]
        assert {k: m[k] for k in SHARED} == {k: twin["model"][k] for k in SHARED}, name
        got = (m.pop("attention"), m.pop("kvsplice_keep"), m.pop("latent_norm"), m.pop("kvsplice_norm"),
               m.pop("qk_rope_head_dim"))
        assert got == (attention, ratio, latent_norm, kvsplice_norm, rope if attention == "mla" else 0), name
        GPTConfig.from_name(prefix + name)  # valid
        stripped.append(cfg)
    assert all(s == stripped[0] for s in stripped[1:])
    assert stripped[0]["model"]["layout"] == "deepseek_v3" and stripped[0]["model"]["bias"] is False
