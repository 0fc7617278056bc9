"""Our own DeepSeek-V3 exports load in our own tools (kvsplice.loading.deepseek_folder through ``load_model``): the
folder ``to-mla --format deepseek_v3`` writes comes back as the converted :class:`MLALlama`, the one ``export --format
deepseek_v3`` writes as the trained :class:`GPT` — padded or not — with the source's logits, greedy tokens and cache
row; ``kvsplice eval-tasks`` runs on the export with the answers of the native folder; folders that are not ours,
or damaged ones, are one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvsplice.convert.deepseek_v3 import save_deepseek_v3
from kvsplice.loading import LoadError, load_model
from models import GPT
from models.checkpoint import save_model
from models.config import GPTConfig
from models.mla_llama import MLALlama
from tiny_models import converted_tiny_llama, sharpen
from training import export as ex

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"
REL = 1e-5  # logits: float round-off of the exported fp32 products only


def word_tokenizer(folder: Path, vocab: int) -> None:
    """A whitespace word-level tokenizer of ``vocab`` ids saved into ``folder`` (an HF tokenizer directory)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2").save_pretrained(str(folder))


def greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    """``n`` greedy tokens through the model's own decode cache (prefill, then one token a step)."""
    cache = model.new_cache(1)
    out, logits = [], model(prompt, cache)
    for _ in range(n):
        out.append(int(logits[0, -1].argmax()))
        logits = model(torch.tensor([[out[-1]]]), cache)
    return out


def same_model(ours, want, vocab: int) -> float:
    """Logits within REL of their scale (a batch of 40 tokens) and the same 16 greedy tokens."""
    ids = torch.randint(0, vocab, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        a, b = ours(ids), want(ids)
        diff = (a - b).abs().max().item()
        assert diff <= REL * b.abs().max().item(), diff
        assert greedy(ours, ids[:1, :5], 16) == greedy(want, ids[:1, :5], 16)
    return diff


# ------------------------------------------------------------------------------------------- converted Llama
@pytest.mark.parametrize("pads", [{}, {"pad_latent": 40, "pad_rope": 32}])
def test_converted_llama_export_is_the_converted_model(tmp_path, pads):
    _, mla = converted_tiny_llama(tmp_path, **pads)  # norm-free: written in the linear regime, undone on load
    word_tokenizer(tmp_path, mla.cfg.vocab_size)
    loaded = load_model(tmp_path)
    got = loaded.model
    assert isinstance(got, MLALlama) and loaded.kind == "mla"
    for f in ("n_kv_head", "head_dim", "d_latent", "rope_dims", "rope_layout", "latent_norm", "norm_eps"):
        assert getattr(got.cfg, f) == getattr(mla.cfg, f), f  # GQA found again, padding cut back
    assert got.cache_bytes_formula(1, 100, torch.float32) == mla.cache_bytes_formula(1, 100, torch.float32)
    same_model(got, mla, mla.cfg.vocab_size)


def test_converted_llama_with_a_latent_norm_and_a_padded_row(tmp_path):
    import transformers

    from kvsplice.convert.llama_mla import calibrate_layers, convert_llama

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5,
                                   tie_word_embeddings=False, initializer_range=0.2)
    src = transformers.LlamaForCausalLM(cfg).eval()
    stats = calibrate_layers(src, [torch.randint(0, 120, (2, 32), generator=torch.Generator().manual_seed(1))])
    mla = convert_llama(src, stats, d_latent=12, rope_dims=8, layout="shared", latent_norm=True)
    save_deepseek_v3(mla, tmp_path, pad_latent=64, pad_rope=16)
    got = load_model(tmp_path, tokenizer=str(word_dir(tmp_path.parent / "tok", 120))).model
    assert (got.cfg.n_kv_head, got.cfg.d_latent, got.cfg.latent_norm, got.cfg.norm_eps) == (1, 12, True, 1e-5)
    same_model(got, mla, 120)


def word_dir(folder: Path, vocab: int) -> Path:
    folder.mkdir(exist_ok=True)
    word_tokenizer(folder, vocab)
    return folder


# ------------------------------------------------------------------------------------------- trained GPT
V = 97
BASE = dict(vocab_size=V, n_layer=2, n_head=4, d_model=32, block_size=64, d_latent=16, bias=False,
            layout="deepseek_v3", d_ff=88)
GPTS = {  # name -> (config fields, export pads)
    "mla": (dict(attention="mla", qk_rope_head_dim=8, latent_norm=True, rope_theta=5e5), {}),
    "kvsplice-untied": (dict(attention="mla", qk_rope_head_dim=4, kvsplice_keep=0.5, kvsplice_norm=True,
                             kvsplice_orthogonal=True, tie_embeddings=False), {}),
    "kvsplice-padded": (dict(attention="mla", qk_rope_head_dim=8, kvsplice_keep=0.25, kvsplice_norm=True),
                        {"pad_latent": 512, "pad_rope": 64}),  # vLLM's CPU row
}


def exported_gpt(tmp_path: Path, name: str):
    fields, pads = GPTS[name]
    torch.manual_seed(0)
    model = sharpen(GPT(GPTConfig(**{**BASE, **fields})), std=0.25)
    ckpt = save_model(model, tmp_path / "model.ckpt")
    out = tmp_path / "out"
    ex.export(ckpt, out, fmt="deepseek_v3", tokenizer=False, **pads)  # `kvsplice export --format deepseek_v3`
    word_tokenizer(out, V)
    return model, out


@pytest.mark.parametrize("name", GPTS)
def test_trained_gpt_export_is_the_trained_model(tmp_path, name):
    model, out = exported_gpt(tmp_path, name)
    loaded = load_model(out)
    got = loaded.model
    assert isinstance(got, GPT) and got.cfg.layout == "deepseek_v3" and got.cfg.attention == "mla"
    assert got.cfg.cache_dim == model.cfg.cache_dim  # KVSplice-r is MLA of latent r: the same cached row
    assert got.cfg.tie_embeddings == model.cfg.tie_embeddings
    same_model(got, model, V)


@pytest.mark.parametrize("interleave", [True, False])
def test_a_dense_deepseek_v3_transformers_writes_is_our_gpt_with_its_logits(tmp_path, interleave):
    """Not only our writer's folders: any dense MLA without q-LoRA that fits the GPT (``d_model = H·D``, eps 1e-6)
    loads with transformers' own logits — the inversion follows DeepSeek-V3 itself, in both RoPE layouts."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        vocab_size=V, hidden_size=32, intermediate_size=88, moe_intermediate_size=88, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=12, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, first_k_dense_replace=2, n_routed_experts=1, n_group=None, topk_group=None,
        rms_norm_eps=1e-6, rope_interleave=interleave, max_position_embeddings=64, tie_word_embeddings=False,
        rope_theta=500.0)
    hf = sharpen(transformers.DeepseekV3ForCausalLM(cfg).float(), std=0.25)
    hf.save_pretrained(tmp_path)
    word_tokenizer(tmp_path, V)
    got = load_model(tmp_path).model
    assert isinstance(got, GPT) and got.cfg.cache_dim == 12 + 8
    ids = torch.randint(0, V, (2, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(ids).logits
        assert (got(ids) - want).abs().max() <= REL * want.abs().max()


# ------------------------------------------------------------------------------------------- refusals
def edit_config(folder: Path, **changes) -> None:
    p = folder / "config.json"
    p.write_text(json.dumps({**json.loads(p.read_text()), **changes}))


@pytest.mark.parametrize("edit,expect", [
    (dict(first_k_dense_replace=0), "MoE layers"),
    (dict(q_lora_rank=8), "low-rank query"),
    (dict(rope_scaling={"type": "yarn", "factor": 4.0}), "RoPE scaling"),
    (dict(kv_lora_rank=12), "wrongly shaped weights"),
    (dict(num_hidden_layers=1), "unexpected weights|weights have 2 numbered layers"),
    (dict(kvsplice={"variant": "ds_mla", "padded": {"kv_lora_rank": [5, 3], "qk_rope_head_dim": [8, 8]}}),
     "not a padding"),
    (dict(rms_norm_eps=1e-5), r"rms_norm_eps 1e-05 \(the GPT's norms use 1e-06\)"),
])
def test_folders_that_are_not_ours_are_one_line(tmp_path, edit, expect):
    _, out = exported_gpt(tmp_path, "mla")
    edit_config(out, **edit)
    with pytest.raises(LoadError, match=expect) as e:
        load_model(out)
    assert "\n" not in str(e.value)


def test_a_padding_that_is_not_exact_and_a_missing_tokenizer_are_one_line(tmp_path):
    _, out = exported_gpt(tmp_path, "kvsplice-padded")
    f = out / "model.safetensors"
    sd = load_file(str(f))
    good = sd["model.layers.1.self_attn.kv_b_proj.weight"].clone()
    sd["model.layers.1.self_attn.kv_b_proj.weight"][:, -1] = 1.0  # reads a padded latent dim: not the writer's pad
    save_file(sd, str(f))
    with pytest.raises(LoadError, match="layer 1's latent beyond kv_lora_rank 4 is not zero"):
        load_model(out)
    sd["model.layers.1.self_attn.kv_b_proj.weight"] = good
    save_file(sd, str(f))
    assert load_model(out).model.cfg.d_latent == 4
    (out / "tokenizer_config.json").unlink()
    with pytest.raises(LoadError, match="pass --tokenizer"):
        load_model(out)


@pytest.mark.parametrize("weight,expect", [
    ("self_attn.q_proj.weight", "RoPE queries are not a map of its head queries"),  # q_rope rows of their own
    ("self_attn.kv_a_layernorm.weight", "not the linear regime"),  # a real norm where config says linear
])
def test_a_converted_export_that_is_not_invertible_is_one_line(tmp_path, weight, expect):
    converted_tiny_llama(tmp_path)
    word_tokenizer(tmp_path, 300)
    f = tmp_path / "model.safetensors"
    sd = load_file(str(f))
    w = sd[f"model.layers.1.{weight}"]
    if weight.endswith("q_proj.weight"):
        w.view(4, 32, -1)[:, 16:] = torch.randn(4, 16, w.shape[-1], generator=torch.Generator().manual_seed(0))
    else:
        w[0] *= 2.0
    save_file(sd, str(f))
    with pytest.raises(LoadError, match=f"layer 1's .*{expect}"):
        load_model(tmp_path)


# ------------------------------------------------------------------------------------------- the CLI
def test_eval_tasks_runs_on_a_converted_stories260k_export(tmp_path, capsys):
    """``kvsplice eval-tasks`` on the DeepSeek-V3 export of a converted stories260K answers as on the native
    converted folder (the same model: the same greedy tokens)."""
    if not (STORIES / "stories260K.bin").is_file():
        pytest.skip(f"stories260K not found under {DATA}")
    import transformers

    from kvsplice.cli.main import main
    from kvsplice.convert.llama2c import convert_llama2c
    from kvsplice.convert.llama_mla import calibrate_layers, convert_llama
    from kvsplice.loading.mla_folder import save_mla_folder

    src_dir = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path / "src")
    src = transformers.AutoModelForCausalLM.from_pretrained(src_dir).eval()
    tok = transformers.AutoTokenizer.from_pretrained(src_dir)
    calib = torch.randint(3, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    mla = convert_llama(src, calibrate_layers(src, [calib]), d_latent=24, rope_dims=8, layout="shared")
    save_deepseek_v3(mla, tmp_path / "ds", tokenizer=tok, pad_latent=32)
    save_mla_folder(mla, tmp_path / "native", tokenizer=tok)
    answers = []
    for name in ("ds", "native"):
        out = tmp_path / f"{name}.json"
        assert main(["eval-tasks", "--model", str(tmp_path / name), "--method", "full", "--tasks", "passkey",
                     "--lengths", "160", "--n", "2", "--setting", "agnostic", "--no-progress",
                     "--out", str(out)]) == 0, capsys.readouterr().err
        doc = json.loads(out.read_text())
        answers.append([r["full"]["tokens"] for r in doc["results"]["agnostic"].values()])
    assert answers[0] == answers[1] and len(answers[0]) == 2


@pytest.mark.slow
def test_smollm2_deepseek_export_is_the_converted_model(tmp_path, capsys):
    """SmolLM2-135M converted (2x shared RoPE, norm-free) and exported padded to vLLM's 512 + 64 row: the export
    loads back as the native folder's model (its logits to REL of their scale, every argmax, its cache bytes)."""
    smol, calib = DATA / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf", \
        DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"
    if not (smol.is_file() and calib.is_file()):
        pytest.skip(f"SmolLM2 / TinyStories not found under {DATA}")
    from kvsplice.cli import to_mla
    from kvsplice.loading import iter_texts, token_stream

    native, ds = tmp_path / "native", tmp_path / "ds"
    assert to_mla.main(["--model", str(smol), "--calib", str(calib), "--calib-tokens", "4096", "--seq-len", "512",
                        "--d-latent", "128", "--rope-layout", "shared", "--out", str(native), "--no-progress"]) == 0
    assert to_mla.main(["--model", str(native), "--format", "deepseek_v3", "--pad-latent", "512", "--pad-rope", "64",
                        "--out", str(ds), "--no-progress"]) == 0, capsys.readouterr().err
    want, got = load_model(native), load_model(ds)
    assert (got.model.cfg.d_latent, got.model.cfg.rope_dims) == (128, 64)
    ids, _ = token_stream(iter_texts(calib), want.tokenizer, 512)
    with torch.no_grad():
        a, b = want.model(ids[None]), got.model(ids[None])
    assert (a - b).abs().max() <= REL * a.abs().max() and torch.equal(a.argmax(-1), b.argmax(-1))
    assert got.model.cache_bytes_formula(1, 1, torch.float32) == want.model.cache_bytes_formula(1, 1, torch.float32)
