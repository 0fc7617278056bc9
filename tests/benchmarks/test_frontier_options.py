"""The frontier study's model and data options on tiny shapes: grouped-query / multi-query attention
(``GPTConfig.n_kv_head``), MLA's latent RMSNorm (``GPTConfig.latent_norm``) and a BPE vocabulary trained on local
files (``data.bpe_vocab_size``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from data.datamodule import TinyStoriesDataModule
from data.errors import DataConfigError
from kvsplice.report.memory import cache_bytes_formula
from models.attention import attend
from models.config import GPTConfig, preset
from models.gpt import GPT


def _model(seed: int = 0, **kw) -> GPT:
    cfg = GPTConfig(vocab_size=61, n_layer=2, n_head=4, d_model=32, block_size=40, **kw)
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():  # away from the init so biases, norms and every projection matter
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def _cached_logits(model: GPT, ids: torch.Tensor, split: int) -> tuple[torch.Tensor, object]:
    cache = model.new_cache(ids.shape[0])
    chunks = [model(ids[:, :split], cache=cache)]
    chunks += [model(ids[:, i:i + 1], cache=cache) for i in range(split, ids.shape[1])]
    return torch.cat(chunks, 1), cache  # (B, T, V)


# ------------------------------------------------------------------------------------------------- GQA / MQA
@pytest.mark.parametrize("n_kv_head", [4, 2, 1])
def test_gqa_cached_decode_equals_forward_and_bytes_equal_formula(n_kv_head: int) -> None:
    model = _model(n_kv_head=n_kv_head)
    ids = torch.randint(0, 61, (3, 17), generator=torch.Generator().manual_seed(1))
    full = model(ids)
    cached, cache = _cached_logits(model, ids, 6)
    assert torch.allclose(full, cached, atol=1e-5), (full - cached).abs().max()
    cfg = model.cfg
    assert cfg.cache_dim == 2 * n_kv_head * 8
    assert cfg.variant == {4: "mha", 2: "gqa2", 1: "mqa"}[n_kv_head]
    assert cache.nbytes() == cache_bytes_formula(cfg, 17, torch.float32, batch_size=3)
    assert cache.nbytes() == 3 * 17 * cfg.n_layer * 2 * n_kv_head * 8 * 4
    k = next(iter(cache.tensors()))
    assert k.shape[1] == n_kv_head  # (B, Hkv, T, hs): only the shared heads are stored


def test_gqa_equals_mha_with_repeated_kv_heads() -> None:
    """A GQA model is the MHA model whose K/V projections repeat each KV head over its query group."""
    gqa = _model(n_kv_head=2)
    mha = GPT(gqa.cfg.replace(n_kv_head=None)).eval()
    sd = gqa.state_dict()
    hs, d = gqa.cfg.head_size, gqa.cfg.d_model
    for i in range(gqa.cfg.n_layer):
        for name in ("weight", "bias"):
            w = sd[f"transformer.h.{i}.attn.c_attn.{name}"]
            q, k, v = w.split([d, 2 * hs, 2 * hs], dim=0)
            k, v = (z.unflatten(0, (2, hs)).repeat_interleave(2, dim=0).flatten(0, 1) for z in (k, v))
            sd[f"transformer.h.{i}.attn.c_attn.{name}"] = torch.cat([q, k, v], 0)
    mha.load_state_dict(sd)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(2))
    assert torch.allclose(gqa(ids), mha(ids), atol=1e-5)


def test_attend_grouped_layout_matches_repeat() -> None:
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(2, 6, 5, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8,
                                                                                                        generator=g)
    got = attend(q, k, v, scale=0.3)
    want = attend(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), scale=0.3)
    assert torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("t_q, window, hq", [(1, 3, 6), (9, 4, 6), (4, 2, 2), (9, 9, 2)])
def test_attend_sliding_window_is_the_masked_softmax(t_q: int, window: int, hq: int) -> None:
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, hq, t_q, 8, generator=g)
    k, v = torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g)
    qpos, kpos = torch.arange(9 - t_q, 9)[:, None], torch.arange(9)[None]
    seen = (kpos <= qpos) & (kpos > qpos - window)  # (Tq, Tk): the last `window` keys up to the query's own
    kk, vv = k.repeat_interleave(hq // 2, 1), v.repeat_interleave(hq // 2, 1)
    want = torch.softmax((q @ kk.transpose(-1, -2) * 0.3).masked_fill(~seen, float("-inf")), -1) @ vv
    assert torch.allclose(attend(q, k, v, scale=0.3, window=window), want, atol=1e-6)
    if window < 9:  # the window changes what a query sees
        assert not torch.allclose(attend(q, k, v, scale=0.3), want, atol=1e-3)
    with pytest.raises(ValueError, match="sliding window"):
        attend(q, k, v, scale=0.3, window=window, backend="flash")


@pytest.mark.parametrize("kw, field", [
    (dict(n_kv_head=3), "n_kv_head"),  # does not divide 4
    (dict(n_kv_head=0), "n_kv_head"),
    (dict(n_kv_head=2, attention="mla", d_latent=16), "n_kv_head"),
    (dict(latent_norm=True), "latent_norm"),  # MHA has no latent
    (dict(latent_norm="yes", attention="mla", d_latent=16), "latent_norm"),
])
def test_bad_options_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(ValueError, match=f"GPTConfig.{field} must be"):
        GPTConfig(vocab_size=61, n_layer=2, n_head=4, d_model=32, block_size=40, **kw)


def test_presets_and_hf_import_unchanged() -> None:
    assert preset("gpt2_gqa4").cache_dim == 2 * 4 * 64 and preset("gpt2_mqa").cache_dim == 2 * 64
    assert preset("gpt2").n_kv_head is None and preset("gpt2").cache_dim == 2 * 768
    transformers = pytest.importorskip("transformers")
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=61, n_positions=40, n_embd=32, n_layer=2,
                                                              n_head=4)).eval()
    ours = GPT.from_hf(hf).eval()
    ids = torch.randint(0, 61, (2, 10), generator=torch.Generator().manual_seed(4))
    assert ours.cfg.kv_heads == 4
    assert torch.allclose(ours(ids), hf(ids).logits, atol=1e-5)


# ------------------------------------------------------------------------------------------------- latent norm
@pytest.mark.parametrize("ratio", [None, 0.5])
def test_latent_norm_exact_in_absorbed_naive_and_forward(ratio) -> None:
    absorbed = _model(attention="mla", d_latent=16, latent_norm=True, kvsplice_keep=ratio, mla_impl="absorb")
    naive = GPT(absorbed.cfg.replace(mla_impl="naive")).eval()
    naive.load_state_dict(absorbed.state_dict())
    ids = torch.randint(0, 61, (2, 15), generator=torch.Generator().manual_seed(5))
    full = absorbed(ids)
    for model in (absorbed, naive):
        cached, cache = _cached_logits(model, ids, 4)
        assert torch.allclose(full, cached, atol=1e-5), (full - cached).abs().max()
        assert cache.nbytes() == cache_bytes_formula(model.cfg, 15, torch.float32, batch_size=2)
    attn = absorbed.transformer.h[0].attn
    assert attn.kv_norm is not None and absorbed.transformer.h[0].attn.kv_norm.weight.requires_grad
    # the cached latent is the normalised one (then compressed): what the cache holds has RMS ~ the norm's gain
    cache = absorbed.new_cache(1)
    x = absorbed.transformer.h[0].ln_1(absorbed.transformer.wte(ids[:1]) + absorbed.transformer.wpe.weight[:15])
    with torch.no_grad():
        absorbed.transformer.h[0].attn(x, cache=cache, layer=0)
        c = attn.kv_norm(attn.w_dkv(x))  # (1, T, d_latent)
        want = attn.splice.compress(c) if attn.splice is not None else c
    got = next(iter(cache.tensors()))  # (1, T, r)
    assert torch.allclose(got, want, atol=1e-6)


def test_latent_norm_changes_the_model_and_is_off_by_default() -> None:
    plain = _model(attention="mla", d_latent=16)
    assert plain.transformer.h[0].attn.kv_norm is None
    normed = GPT(plain.cfg.replace(latent_norm=True)).eval()
    missing = normed.load_state_dict(plain.state_dict(), strict=False).missing_keys
    assert missing == [f"transformer.h.{i}.attn.kv_norm.weight" for i in range(2)]
    ids = torch.randint(0, 61, (1, 9), generator=torch.Generator().manual_seed(6))
    assert not torch.allclose(plain(ids), normed(ids), atol=1e-4)


# ------------------------------------------------------------------------------------------------- local BPE
def _stories(path: Path, n: int, seed: int) -> Path:
    g = torch.Generator().manual_seed(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "Lily", "saw", "big", "red", "ball", "and", "ran", "home"]
    letters = "abcdefghijklmnopqrstuvwxyz"
    words += ["".join(letters[int(j)] for j in torch.randint(0, 26, (5,), generator=torch.Generator().manual_seed(k)))
              for k in range(150)]  # the same 150 made-up words in every file: enough pairs to merge
    stories = [" ".join(words[int(i)] for i in torch.randint(0, len(words), (30,), generator=g)) + "."
               for _ in range(n)]
    path.write_text("\n<|endoftext|>\n".join(stories), encoding="utf-8")
    return path


def test_bpe_vocab_trained_on_local_train_files_and_cached(tmp_path: Path) -> None:
    train = _stories(tmp_path / "train.txt", 200, 0)
    val = _stories(tmp_path / "held.txt", 40, 1)
    kw = dict(path=str(train), val_path=str(val), bpe_vocab_size=300, block_size=16, batch_size=2,
              cache_dir=str(tmp_path / "cache"), val_batches=2)
    dm = TinyStoriesDataModule(**kw)
    tok = dm.tokenizer
    assert tok.vocab_size == 300 and tok.name == "local-bpe-300"
    text = "Lily saw the big red ball."
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(text)) < len(text.encode()) * 0.8  # merges learned from the stories
    files = list((tmp_path / "cache" / "tokenizers").glob("local-bpe300-*.json"))
    assert len(files) == 1
    mtime = files[0].stat().st_mtime_ns
    dm2 = TinyStoriesDataModule(**kw)  # a second module loads the cached vocabulary instead of retraining
    assert dm2.tokenizer.fingerprint == tok.fingerprint and files[0].stat().st_mtime_ns == mtime
    dm2.setup()
    x, y = next(iter(dm2.train_dataloader()))
    assert x.shape == (2, 16) and int(x.max()) < 300 and torch.equal(x[:, 1:], y[:, :-1])
    assert dm2.meta["tokenizer"]["vocab_size"] == 300
    # a different training file gives a different cached vocabulary
    other = _stories(tmp_path / "other.txt", 200, 7)
    dm3 = TinyStoriesDataModule(**{**kw, "path": str(other)})
    assert dm3.tokenizer.fingerprint != tok.fingerprint


@pytest.mark.parametrize("kw, msg", [
    (dict(bpe_vocab_size=100), r"data.bpe_vocab_size must be an integer in \[258, 65536\]"),
    (dict(bpe_vocab_size=True), "data.bpe_vocab_size must be"),
    (dict(bpe_vocab_size=70000), "data.bpe_vocab_size must be"),
    (dict(bpe_vocab_size=512, path=None, synthetic=True), "set data.path too"),
    (dict(bpe_vocab_size=512, tokenizer_path="x"), "mutually exclusive"),
])
def test_bpe_vocab_bad_values(tmp_path: Path, kw: dict, msg: str) -> None:
    base = dict(path=str(_stories(tmp_path / "t.txt", 5, 0)), block_size=8, cache_dir=str(tmp_path / "c"))
    with pytest.raises(DataConfigError, match=msg):
        TinyStoriesDataModule(**{**base, **kw})


SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "tinystories"


@pytest.mark.skipif(not SHARED.is_dir(), reason="../shared/data/tinystories not available")
def test_small_configs_read_real_tinystories(tmp_path: Path) -> None:
    """configs/small_*.yaml: the folder's *val* file is the validation text, the BPE is trained on the others."""
    import yaml

    from models.config import config_path

    data = yaml.safe_load(config_path("small_mha").read_text())["data"]
    assert data["bpe_vocab_size"] == 4096 and data["path"] == "../shared/data/tinystories"
    dm = TinyStoriesDataModule(path=str(SHARED), bpe_vocab_size=512, block_size=64, cache_dir=str(tmp_path))
    train, val = dm.stories.files()
    assert [f.name for f in val] == ["yuninxia_moe-routing-bench__tinystories_val.txt"]
    assert len(train) == 3 and all("val" not in f.name for f in train)
    for name in ("small_mha", "small_gqa2", "small_mqa", "small_mla", "small_mla_64", "small_mla_32",
                 "small_mla_kvsplice_50", "small_mla_kvsplice_70", "small_mla_kvsplice_90"):
        cfg = GPTConfig.from_name(name, vocab_size=4096)
        assert (cfg.n_layer, cfg.n_head, cfg.d_model, cfg.block_size) == (4, 4, 128, 256)
    assert [GPTConfig.from_name(n, vocab_size=4096).cache_dim for n in
            ("small_mha", "small_gqa2", "small_mqa", "small_mla", "small_mla_64", "small_mla_32",
             "small_mla_kvsplice_50", "small_mla_kvsplice_70", "small_mla_kvsplice_90")] == [256, 128, 64, 128, 64,
                                                                                              32, 64, 38, 13]
