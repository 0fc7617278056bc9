"""``kvsplice generate``: HF generate() with the full / coefficient / token-subset cache, the JSON report
(tokens, text, measured cache bytes), and one-line errors with exit status 2 and nothing overwritten — hostile bases,
models, temperatures, destinations and prompts included (the stories260K tests skip without ../shared/data)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from hostile import one_error, readonly_dir, tiny_ckpt, tiny_hf_with_bases  # noqa: F401
from kvsplice.cli import generate as cli
from kvsplice.lowrank.bases import KVBases
from models.generate import check_sampling, sample_next
from test_hf_cache import random_bases
from training.export import export

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"
PROMPT = "Once upon a time, there was a little girl"


@pytest.fixture(scope="module")
def s260k(tmp_path_factory):
    from kvsplice.convert.llama2c import convert_llama2c

    if not (STORIES / "stories260K.bin").is_file():
        pytest.skip(f"stories260K not found under {STORIES}")
    d = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("s260k"))
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    files = {}
    for rank, rope in ((8, "post"), (4, "post"), (4, "pre")):
        files[(rank, rope)] = random_bases(model, rank, rope, seed=5).save(d.parent / f"r{rank}_{rope}.safetensors")
    return d, model, transformers.AutoTokenizer.from_pretrained(d), files


def run(argv, capsys):
    capsys.readouterr()
    rc = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def report(s260k, tmp_path, capsys, *extra, n=12):
    d = s260k[0]
    out = tmp_path / "g.json"
    rc, _, err = run(["--model", d, "--prompt", PROMPT, "--max-new-tokens", n, "--json", out, "--force", *extra],
                     capsys)
    assert rc == 0, err
    return json.loads(out.read_text())


def test_full_cache_is_hf_greedy_and_lossless_caches_match_it(s260k, tmp_path, capsys):
    d, model, tok, files = s260k
    ids = torch.tensor([[tok.bos_token_id] + tok.encode(PROMPT, add_special_tokens=False)])
    want = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
    full = report(s260k, tmp_path, capsys)
    assert full["prompt_tokens"] == ids[0].tolist() and full["tokens"] == want
    assert full["text"] == tok.decode(want, skip_special_tokens=True)
    t = ids.shape[1] + 12 - 1
    assert full["cache_bytes"] == full["full_cache_bytes"] == 2 * 5 * 4 * 8 * t * 4
    lossless = report(s260k, tmp_path, capsys, "--bases", files[(8, "post")])
    assert lossless["tokens"] == want and lossless["cache_bytes"] == full["cache_bytes"]
    sel = report(s260k, tmp_path, capsys, "--select", "uniform", "--budget", 1000)
    assert sel["tokens"] == want and sel["cache_bytes"] == sel["cache_bytes_formula"]


@pytest.mark.parametrize("rope", ["post", "pre"])
def test_rank4_cache_bytes_are_half_of_full(s260k, tmp_path, capsys, rope):
    rep = report(s260k, tmp_path, capsys, "--bases", s260k[3][(4, rope)])
    assert rep["cache_bytes"] == rep["cache_bytes_formula"] == rep["full_cache_bytes"] // 2
    assert len(rep["tokens"]) >= 1


def test_selection_and_sampling(s260k, tmp_path, capsys):
    a = report(s260k, tmp_path, capsys, "--select", "balancekv", "--budget", 6, "--temperature", 0.8, "--top-k", 20)
    b = report(s260k, tmp_path, capsys, "--select", "balancekv", "--budget", 6, "--temperature", 0.8, "--top-k", 20)
    assert a["tokens"] == b["tokens"]  # seeded
    held = a["cache_tokens_held"]
    assert held == 6 + len(a["tokens"]) - 1
    assert a["cache_bytes"] == a["cache_bytes_formula"] == 5 * 4 * held * (8 + 8 + 1) * 4


def test_bad_inputs_are_one_line_exit_2_and_nothing_is_overwritten(s260k, tmp_path, capsys):
    d, files = s260k[0], s260k[3]
    out = tmp_path / "keep.json"
    out.write_text("keep")
    other = random_bases(transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8)), 4, "post").save(tmp_path / "other.safetensors")
    base = ["--model", d, "--prompt", PROMPT, "--max-new-tokens", 4]
    bad = {
        "exists": [*base, "--json", out],
        "bases and select": [*base, "--bases", files[(4, "post")], "--select", "uniform", "--budget", 4],
        "select without budget": [*base, "--select", "uniform"],
        "budget without select": [*base, "--budget", 4],
        "unknown selector": [*base, "--select", "nope", "--budget", 4],
        "zero budget": [*base, "--select", "uniform", "--budget", 0],
        "negative temperature": [*base, "--temperature", -1],
        "nan temperature": [*base, "--temperature", "nan"],
        "top-k greedy": [*base, "--top-k", 5],
        "zero new tokens": ["--model", d, "--prompt", PROMPT, "--max-new-tokens", 0],
        "empty prompt": ["--model", d, "--prompt", "  ", "--max-new-tokens", 4],
        "too long": ["--model", d, "--prompt", PROMPT, "--max-new-tokens", 100000],
        "missing bases": [*base, "--bases", tmp_path / "nope.safetensors"],
        "not bases": [*base, "--bases", out],
        "other model's bases": [*base, "--bases", other],
        "missing model": ["--model", tmp_path / "nope", "--prompt", PROMPT, "--max-new-tokens", 4],
        "missing option": ["--model", d, "--max-new-tokens", 4],
    }
    for name, argv in bad.items():
        rc, stdout, err = run(argv, capsys)
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("kvsplice generate: error: "), (name, err)
        assert out.read_text() == "keep", name
    assert KVBases.load(files[(4, "post")]).n_layer == 5


# ------------------------------------------------------------------------------------------ hostile inputs
# Hostile inputs to ``kvsplice generate``: bases with NaN / inf / integer / misshapen tensors
# and models with NaN weights are refused naming the file and the tensor (they printed empty or garbage text, exit 0),
# a non-finite temperature is refused (``inf`` sampled uniform noise), a read-only ``--json`` folder and a
# non-UTF-8 prompt are one line, and an exported remote-code folder is refused at once instead of stopping at
# transformers' interactive ``[y/N]`` prompt.

T = "layers.1.heads.0.k_dec"


@pytest.fixture(scope="module")
def hf(tmp_path_factory, data_cache):
    return tiny_hf_with_bases(tmp_path_factory.mktemp("gen"), data_cache)


def edit_bases(src: Path, dst: Path, name: str, value: torch.Tensor) -> Path:
    """A copy of the bases file ``src`` (metadata kept) with tensor ``name`` replaced by ``value``."""
    with safe_open(str(src), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(src))
    tensors[name] = value
    save_file(tensors, str(dst), metadata=meta)
    return dst


@pytest.mark.parametrize("name, value, expect", [
    ("nan", torch.full((16, 4), float("nan")), f"tensor {T} holds 64 NaN/inf values"),  # item 5
    ("inf", torch.full((16, 4), float("inf")), f"tensor {T} holds 64 NaN/inf values"),
    ("int32", torch.ones(16, 4, dtype=torch.int32), f"tensor {T} has dtype int32"),  # item 6
    ("shape", torch.zeros(16, 3), f"tensor {T} has shape (16, 3), expected (16, 4)"),
    ("vector", torch.zeros(16), f"tensor {T} has shape (16,), expected (16, 4)"),
])
def test_bad_bases_are_refused_naming_file_and_tensor(hf, tmp_path, capsys, name, value, expect):
    model, good = hf
    bad = edit_bases(good, tmp_path / f"{name}.safetensors", T, value)
    rc, out, err = run(["--model", model, "--bases", bad, "--prompt", "Once upon a time", "--max-new-tokens", 4],
                       capsys)
    assert str(bad) in one_error(rc, err, "generate", expect)
    assert out == ""  # no (empty or garbage) text


def test_rank_above_head_dim_is_refused(hf, tmp_path, capsys):
    model, good = hf
    wide = {n: torch.eye(16, 17) for n in ("k_enc", "k_dec")}
    bad = good
    for n, v in wide.items():
        bad = edit_bases(bad, tmp_path / f"wide_{n}.safetensors", f"layers.0.heads.1.{n}", v)
    rc, _, err = run(["--model", model, "--bases", bad, "--prompt", "Once", "--max-new-tokens", 2], capsys)
    one_error(rc, err, "generate", "has shape (16, 17), expected (head_dim, rank) with 1 <= rank <= head_dim")


def test_nan_weights_in_a_model_folder_are_refused(hf, tmp_path, capsys):
    src, _ = hf
    model = shutil.copytree(src, tmp_path / "nan")
    w = load_file(str(model / "model.safetensors"))
    w["transformer.h.0.mlp.c_fc.weight"][3, 5] = float("nan")
    save_file(w, str(model / "model.safetensors"), metadata={"format": "pt"})
    rc, out, err = run(["--model", model, "--prompt", "Once", "--max-new-tokens", 2], capsys)
    one_error(rc, err, "generate", "tensor transformer.h.0.mlp.c_fc.weight holds 1 NaN/inf value")
    assert out == ""


@pytest.mark.parametrize("edit, expect", [
    (lambda w: w.pop("transformer.h.1.attn.c_proj.weight"), "lacks weights of the model (transformer.h.1.attn.c_proj"),
    (lambda w: w.update(extra=torch.zeros(3)), "holds unexpected weights of the model (extra)")])
def test_a_model_folder_lacking_or_adding_weights_is_refused(hf, tmp_path, capsys, edit, expect):
    """transformers initialised a missing weight at random (and warned, behind the hidden log): now one line."""
    src, _ = hf
    model = shutil.copytree(src, tmp_path / "cut")
    w = load_file(str(model / "model.safetensors"))
    edit(w)
    save_file(w, str(model / "model.safetensors"), metadata={"format": "pt"})
    rc, out, err = run(["--model", model, "--prompt", "Once", "--max-new-tokens", 2], capsys)
    one_error(rc, err, "generate", expect)
    assert out == ""


@pytest.mark.parametrize("temperature", ["inf", "-inf", "1e999", "nan", "-0.5"])
def test_non_finite_temperature_is_refused(hf, capsys, temperature):
    rc, out, err = run(["--model", hf[0], "--prompt", "Once", "--max-new-tokens", 2, f"--temperature={temperature}"],
                       capsys)
    one_error(rc, err, "generate", "--temperature: must be a number in [0, 100]")
    logits = torch.randn(1, 10)
    with pytest.raises(ValueError, match=r"a number in \[0, 100\]"):
        sample_next(logits, float(temperature))  # the sampler itself refuses, whoever calls it
    with pytest.raises(ValueError, match=r"a number in \[0, 100\]"):
        check_sampling(2, float(temperature), None)


def test_json_destination_and_prompt_errors_are_one_line(hf, tmp_path, readonly_dir, capsys):
    model, bases = hf
    base = ["--model", model, "--prompt", "Once", "--max-new-tokens", 2]
    cases = [  # item 9: a read-only --json folder was a traceback after generating
        (["--json", readonly_dir / "out.json"], "cannot write in"),
        (["--json", bases, "--bases", bases, "--force"], "is the input --bases"),
        (["--json", model / "config.json", "--force"], "is a file of the input --model"),
        (["--json", tmp_path], "is a directory"),
    ]
    for extra, expect in cases:
        rc, out, err = run(base + extra, capsys)
        one_error(rc, err, "generate", expect)
        assert out == ""
    # item 10: bytes that are not UTF-8 reach sys.argv as lone surrogates (os.fsdecode)
    prompt = "Once upon a \udcff\udcfe time"
    rc, out, err = run(["--model", model, "--prompt", prompt, "--max-new-tokens", 2], capsys)
    one_error(rc, err, "generate", "--prompt is not valid UTF-8 text")


def test_remote_code_folder_is_refused_without_prompting(tmp_path, data_cache, capsys):
    """Item 10: transformers asked "Do you wish to run the custom code? [y/N]" and waited 15 s."""
    d = export(tiny_ckpt(tmp_path / "mla.ckpt", data_cache, attention="mla"), tmp_path / "remote")["out"]
    t0 = time.perf_counter()
    rc, out, err = run(["--model", d, "--prompt", "Once", "--max-new-tokens", 2], capsys)
    assert time.perf_counter() - t0 < 10
    one_error(rc, err, "generate", "holds custom model code")
    assert "[y/N]" not in out + err


@pytest.mark.parametrize("option", ["--max-new-tokens", "--top-k"])
def test_huge_counts_are_refused_before_the_model_loads(tmp_path, capsys, option):
    extra = ["--temperature", "1"] if option == "--top-k" else []
    args = ["--model", tmp_path / "no_model", "--prompt", "Once", "--max-new-tokens", 2, *extra, option, 10**20]
    rc, out, err = run(args, capsys)  # the missing model is never reached
    one_error(rc, err, "generate", f"{option} must be <= ")
