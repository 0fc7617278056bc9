"""``python -m kvsplice.generate``: HF generate() with the full / coefficient / token-subset cache, the JSON report
(tokens, text, measured cache bytes), and one-line errors with exit status 2 and nothing overwritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from kvsplice import generate as cli
from kvsplice.lowrank.bases import KVBases
from test_hf_cache import random_bases

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
STORIES = DATA / "stories260K"
pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file(),
                                reason=f"stories260K not found under {STORIES}")
PROMPT = "Once upon a time, there was a little girl"


@pytest.fixture(scope="module")
def s260k(tmp_path_factory):
    from kvsplice.convert.llama2c import convert_llama2c

    d = convert_llama2c(STORIES / "stories260K.bin", STORIES / "tok512.bin", tmp_path_factory.mktemp("s260k"))
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    files = {}
    for rank, rope in ((8, "post"), (4, "post"), (4, "pre")):
        files[(rank, rope)] = random_bases(model, rank, rope, seed=5).save(d.parent / f"r{rank}_{rope}.safetensors")
    return d, model, transformers.AutoTokenizer.from_pretrained(d), files


def run(argv, capsys):
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
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("generate: error: "), (name, err)
        assert out.read_text() == "keep", name
    assert KVBases.load(files[(4, "post")]).n_layer == 5
