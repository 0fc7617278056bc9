"""The vLLM plugin (kvsplice.convert.engines.vllm_plugin): vLLM serves the unpadded DeepSeek-V3 exports, any latent row.

Without vLLM (always run): the plugin's attention math — the paged latent decode against a naive per-token
reference (several blocks in shuffled order, a batch of different lengths), the cache write with vLLM's padding
slots, and the absorbed decode (latent query, latent output, then ``W_UV``) equal to plain attention over the
up-projected keys and values; the plugin does not import vLLM until vLLM calls it; its entry point is the one
pyproject.toml declares and the runner's path folder exposes it.

With vLLM (marker ``engines``, skipped in one line without vLLM's venv): a tiny KVSplice-90 DeepSeek-V3 export
(``tiny_ds_mla_kvsplice_90``'s shapes, random weights: latent 6 + RoPE 8) unpadded, in blocks of 16 over 96
tokens, batched with other prompts — vLLM's greedy 32 tokens are transformers', every token's log-probability
within 1e-4, its cache row the model's 14 numbers; vLLM's own count of cache tokens for the same KV memory is
≥ 0.9 × 576 / 14 times the padded export's; the padded 576 row still runs on vLLM's own kernel, exactly.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvsplice.convert.engines import vllm as vllm_engine
from kvsplice.convert.engines.vllm_plugin import paged_mla

ROOT = Path(__file__).resolve().parents[3]


def naive_decode(q_latent, q_pe, cache, block_table, seq_lens, scale):
    """Token by token: gather sequence b's rows through its block table, softmax, weighted latent sum."""
    b, n, latent = q_latent.shape
    bs = cache.shape[1]
    out = torch.zeros(b, n, latent, dtype=torch.float64)
    for i in range(b):
        rows = torch.stack([cache[block_table[i, t // bs], t % bs] for t in range(int(seq_lens[i]))]).double()
        q = torch.cat([q_latent[i], q_pe[i]], -1).double()  # (N, L + R)
        p = torch.softmax(q @ rows.T * scale, -1)  # (N, S)
        out[i] = p @ rows[:, :latent]
    return out


def paged_case(seed=0, latent=6, rope=8, bs=4, lens=(1, 7, 13, 4), heads=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    n_blocks = 16
    cache = torch.randn(n_blocks, bs, latent + rope, generator=g, dtype=dtype)
    per = max(-(-s // bs) for s in lens)
    table = torch.randperm(n_blocks, generator=g)[: len(lens) * per].view(len(lens), per)  # disjoint, shuffled
    q_latent = torch.randn(len(lens), heads, latent, generator=g, dtype=dtype)
    q_pe = torch.randn(len(lens), heads, rope, generator=g, dtype=dtype)
    return q_latent, q_pe, cache, table.int(), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_paged_decode_equals_the_naive_reference(dtype, tol):
    q_latent, q_pe, cache, table, lens = paged_case(dtype=dtype)
    got = paged_mla.paged_latent_decode(q_latent, q_pe, cache, table, lens, 0.3)
    assert got.shape == (4, 3, 6) and got.dtype == dtype
    assert (got.double() - naive_decode(q_latent, q_pe, cache, table, lens, 0.3)).abs().max() <= tol
    # rows past a sequence's length (and other sequences' blocks) are never read
    cache2 = cache.clone()
    for i, s in enumerate(lens.tolist()):
        for t in range(s, table.shape[1] * cache.shape[1]):
            cache2[table[i, t // cache.shape[1]], t % cache.shape[1]] = 1e4
    unused = sorted(set(range(cache.shape[0])) - set(table.flatten().tolist()))
    cache2[unused] = -1e4
    assert torch.equal(paged_mla.paged_latent_decode(q_latent, q_pe, cache2, table, lens, 0.3), got)


def test_cache_write_fills_the_slots_and_skips_padding():
    cache = torch.zeros(3, 4, 5)
    kv_c, k_pe = torch.arange(8.0).view(4, 2), -torch.arange(12.0).view(4, 1, 3)  # 4 tokens: L = 2, R = 3
    paged_mla.write_latent_cache(cache, kv_c, k_pe, torch.tensor([9, -1, 0, 5]))
    flat = cache.view(-1, 5)
    assert flat[9].tolist() == [0, 1, 0, -1, -2] and flat[0].tolist() == [4, 5, -6, -7, -8]
    assert flat[5].tolist() == [6, 7, -9, -10, -11]
    assert int((flat.abs().sum(-1) > 0).sum()) == 3  # the padding token (-1) wrote nothing


def test_absorbed_decode_is_plain_attention_over_the_up_projected_cache():
    """What vLLM does around the plugin: q_nope · W_UK into latent space, the plugin's paged decode, then W_UV —
    equal to softmax(q · k) · v with k = [c W_UK ; k_pe], v = c W_UV, per head (float64)."""
    g = torch.Generator().manual_seed(3)
    heads, nope, vdim, latent, rope, bs = 2, 5, 4, 6, 8, 4
    lens = (9, 3)
    q_latent0, q_pe, cache, table, seq = paged_case(seed=3, latent=latent, rope=rope, bs=bs, lens=lens,
                                                    heads=heads, dtype=torch.float64)
    w_uk = torch.randn(heads, nope, latent, generator=g, dtype=torch.float64)
    w_uv = torch.randn(heads, latent, vdim, generator=g, dtype=torch.float64)
    q_nope = torch.randn(len(lens), heads, nope, generator=g, dtype=torch.float64)
    q_latent = torch.einsum("bhp,hpl->bhl", q_nope, w_uk)  # (B, N, L)
    scale = (nope + rope) ** -0.5
    lat = paged_mla.paged_latent_decode(q_latent, q_pe, cache, table, seq, scale)  # (B, N, L)
    got = torch.einsum("bhl,hlv->bhv", lat, w_uv)
    for i, s in enumerate(lens):
        rows = torch.stack([cache[table[i, t // bs], t % bs] for t in range(s)])  # (S, L + R)
        c, kpe = rows[:, :latent], rows[:, latent:]
        for h in range(heads):
            k = torch.cat([c @ w_uk[h].T, kpe], -1)  # (S, nope + R)
            v = c @ w_uv[h]  # (S, V)
            p = torch.softmax(torch.cat([q_nope[i, h], q_pe[i, h]]) @ k.T * scale, -1)
            assert torch.allclose(got[i, h], p @ v, atol=1e-12)


def test_plugin_imports_no_vllm_until_registered():
    code = ("import sys, kvsplice, kvsplice.convert.engines.vllm_plugin as p, kvsplice.convert.engines.vllm; "
            "import kvsplice.convert.engines.vllm_plugin.paged_mla; print(sorted(m for m in sys.modules "
            "if m == 'vllm' or m.startswith('vllm.')), callable(p.register))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["[]", "True"], out.stderr[-2000:]


def test_entry_point_is_declared_and_exposed(tmp_path):
    """pyproject.toml's ``vllm.general_plugins`` entry point is the runner's, and the runner's path folder exposes
    it to importlib.metadata (how vLLM finds plugins) with this checkout's package behind it."""
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    eps = proj["project"]["entry-points"]["vllm.general_plugins"]
    name, target = (s.strip() for s in vllm_engine.PLUGIN_ENTRY.split("="))
    assert eps == {name: target} and "vllm" in proj["project"]["optional-dependencies"]
    folder = vllm_engine.plugin_path(tmp_path / "p")
    found = [ep for d in importlib.metadata.distributions(path=[str(folder)]) for ep in d.entry_points
             if ep.group == "vllm.general_plugins"]
    assert [(ep.name, ep.value) for ep in found] == [(name, target)]
    assert (folder / "kvsplice" / "convert" / "engines" / "vllm_plugin" / "__init__.py").is_file()
    assert vllm_engine.plugin_path(folder) == folder  # again: idempotent


def test_cache_bytes_per_token_for_mla_and_paged_mha_layers():
    """An MLA layer's cache is one row per token; a standard-attention layer's (vLLM's CPU_ATTN: blocks, KV heads,
    2 x block size, head) counts its tensor's bytes over the cache's tokens."""
    mla = {"backend": "CPU_MLA", "kv_cache_shape": [293, 16, 42], "element_size": 4, "kv_cache_bytes": 293 * 16 * 168}
    mha = {"backend": "CPU_ATTN", "kv_cache_shape": [10, 12, 64, 64], "element_size": 4,
           "kv_cache_bytes": 10 * 12 * 64 * 64 * 4}
    assert vllm_engine.VllmRun(layers=[mla] * 12, cache_tokens=293 * 16).kv_bytes_per_token == 12 * 42 * 4
    assert vllm_engine.VllmRun(layers=[mha] * 12, cache_tokens=320).kv_bytes_per_token == 12 * 2 * 768 * 4


def test_runner_finds_the_venv_under_the_repository_root(monkeypatch):
    """The default interpreter is ``build/vllm-venv/bin/python`` under the repository root (not the package)."""
    monkeypatch.delenv(vllm_engine.ENV, raising=False)
    assert vllm_engine.REPO == ROOT
    assert vllm_engine.vllm_python() == ROOT / "build" / "vllm-venv" / "bin" / "python"


def test_benchmark_formula_ratios_and_report(monkeypatch, tmp_path, capsys):
    """benchmarks/engines_vllm_plugin.py: the bytes-per-token formula (124M: standard attention 73,728 B, KVSplice-90
    2,016 B in fp32), decode ratios against standard attention per group, the markdown; without vLLM one line."""
    from models.config import GPTConfig
    from tiny_models import load_benchmark

    from benchmarks.harness import report
    from benchmarks.lib import engines as lib

    bench = load_benchmark("engines_vllm_plugin")
    from kvsplice.report.memory import cache_bytes_formula  # the formula the study's budgets and rows use

    assert cache_bytes_formula(GPTConfig.from_name("ds_mha"), 1, torch.float32) == 12 * 2 * 768 * 4
    assert cache_bytes_formula(GPTConfig.from_name("ds_mla_kvsplice_90"), 1, torch.float32) == 12 * (26 + 16) * 4

    def row(model, tok_s, plugin=True):
        return dict(model=model, plugin=plugin, backend="CPU_MLA", decode_kernel="torch", row=42,
                    bytes_per_token=2016, bytes_per_token_formula=2016, cache_tokens_vllm=4672,
                    cache_tokens_formula=4681, greedy_equal=True, max_abs_logprob_diff=1e-6,
                    throughput=dict(seqs=36, max_batch=36, median_decode_tok_s=tok_s, decode_tok_s=tok_s / 2,
                                    prefill_seconds=3.0))

    rows = [row("ds_mha (124M shapes, random)", 10.0), row("ds_mla_kvsplice_90 (124M shapes, random)", 25.0),
            row("ds_mla_kvsplice_90 (124M shapes, random)", 5.0, plugin=False),
            row("ds_mha (tiny, 20 steps)", 100.0), row("ds_mla_kvsplice_90 (tiny, 20 steps)", 50.0)]
    rows.append(dict(model="ds_mla_kvsplice_90 (tiny, 20 steps)", plugin=False, row=None, bytes_per_token_formula=9216,
                     cache_tokens_formula=85, error="the budget holds 85 tokens, under one 128-token sequence"))
    r = lib.ratios(rows)
    assert r == {"ds_mla_kvsplice_90 (124M shapes, random) vs standard attention": 2.5,
                 "ds_mla_kvsplice_90 (124M shapes, random), padded vs standard attention": 0.5,
                 "ds_mla_kvsplice_90 (tiny, 20 steps) vs standard attention": 0.5}
    for x in rows:
        x["kv_budget"] = 786432 if "tiny" in x["model"] else 23592960
    run = SimpleNamespace(notes={})
    assert bench.summary(run, [dict(x, vllm="0.32.0") for x in rows])["ratios"] == r
    md = report.markdown(bench.STUDY.spec("report"), run.notes["report"], run.notes)
    assert md.count("\n| ds_") == 6 + len(r) and "| plugin | CPU_MLA / torch | 42 | 2,016 (=) |" in md and "under one 128-token sequence" in md and "padded 512+64, vLLM alone" in md and "2.50×" in md
    assert "124M shapes 23,592,960 B; tiny 786,432 B" in md
    monkeypatch.setenv(vllm_engine.ENV, str(tmp_path / "none" / "python"))
    assert bench.main(["--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("engines_vllm_plugin: error: vLLM's python not found") and "\n" not in err
    assert not (tmp_path / "o.json").exists()


# ------------------------------------------------------------------------------------------------ vLLM itself
TINY = "tiny_ds_mla_kvsplice_90"
TEXT_LEN, PROMPT, NEW, BUDGET = 96, 8, 32, 64 * 2 ** 20


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    why = vllm_engine.missing()
    if why:
        pytest.skip(why)
    from models import GPT
    from models.checkpoint import save_model
    from models.config import GPTConfig
    from tiny_models import sharpen
    from training import export as ex

    torch.manual_seed(0)
    cfg = GPTConfig.from_name(TINY, vocab_size=512)
    model = sharpen(GPT(cfg), std=0.25).eval()
    d = tmp_path_factory.mktemp("vllm_plugin")
    ckpt = save_model(model, d / "model.ckpt")
    ex.export(ckpt, d / "hf", fmt="deepseek_v3")
    ex.export(ckpt, d / "hf_padded", fmt="deepseek_v3", pad_latent=512, pad_rope=64)
    return cfg, d


def _reference(folder: Path, ids: list[int]):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0]  # (T, V)
        lp = torch.log_softmax(logits[:-1].double(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
        g = hf.generate(torch.tensor([ids[:PROMPT]]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    return g[0, PROMPT:].tolist(), lp.tolist()


def _run(folder: Path, ids: list[int]):
    others = [ids[40:90], ids[3:20], ids[:5]]  # batched beside the prompt: prefills and decodes of other lengths
    return vllm_engine.run(folder, prompt=ids[:PROMPT], new=NEW, score=ids, others=others, max_model_len=128,
                           kv_cache_bytes=BUDGET)


@pytest.mark.engines
def test_unpadded_export_in_vllm_is_exact_and_keeps_the_true_row(exports):
    cfg, d = exports
    ids = torch.randint(0, 512, (TEXT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy, lp = _reference(d / "hf", ids)
    run = _run(d / "hf", ids)
    la = run.layers[0]
    assert (la["backend"], la["impl"], la["kernel"]) == ("CPU_MLA", "AnyRowCPUMLAImpl", "torch")
    row = cfg.d_cached_latent + cfg.qk_rope_head_dim
    assert (row, la["kv_cache_shape"][1:]) == (14, [16, 14])  # blocks of 16: the 96 + 32 tokens span 8 of them
    assert run.kv_bytes_per_token == cfg.n_layer * row * 4
    assert run.greedy == greedy and len(set(greedy)) > 4
    assert max(abs(a - b) for a, b in zip(run.logprobs[1:], lp)) <= 1e-4
    padded = _run(d / "hf_padded", ids)
    lp_ = padded.layers[0]
    assert (lp_["backend"], lp_["kernel"], lp_["kv_cache_shape"][-1]) == ("CPU_MLA", "vllm", 576)
    assert padded.greedy == greedy and max(abs(a - b) for a, b in zip(padded.logprobs[1:], lp)) <= 1e-4
    # capacity: vLLM's own count of cache tokens in the same KV memory
    assert run.kv_cache_bytes == padded.kv_cache_bytes == BUDGET
    assert run.cache_tokens >= 0.9 * (576 / row) * padded.cache_tokens, (run.cache_tokens, padded.cache_tokens)
    print(json.dumps({"unpadded_tokens": run.cache_tokens, "padded_tokens": padded.cache_tokens}))


@pytest.mark.engines
def test_vllm_loads_the_plugin_through_its_entry_point(tmp_path):
    """vLLM's own plugin loader finds the entry point and points CPU_MLA (only) at the any-row backend."""
    why = vllm_engine.missing()
    if why:
        pytest.skip(why)
    code = ("from vllm.plugins import load_general_plugins; load_general_plugins(); "
            "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E; "
            "print(E.CPU_MLA.get_path(), E.AMX_MLA.get_path(), E.CPU_MLA.get_class().get_supported_head_sizes())")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(vllm_engine.plugin_path(tmp_path / "p"))
    out = subprocess.run([str(vllm_engine.vllm_python()), "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    cpu, amx, sizes = out.stdout.split()[-3:]
    assert cpu == vllm_engine.PLUGIN_ENTRY.split("= ")[1].split(":")[0] + ".cpu_backend.AnyRowCPUMLABackend"
    assert amx.startswith("vllm.") and sizes == "[]"



@pytest.mark.engines
def test_unpadded_converted_llama_in_vllm_is_exact(tmp_path):
    """A tiny Llama converted to MLA (latent 16 + 16 shared RoPE: a 32-number row) and exported unpadded
    (``to_mla --format deepseek_v3``'s writer): vLLM through the plugin gives transformers' greedy 32 tokens and
    log-probabilities within 1e-4."""
    why = vllm_engine.missing()
    if why:
        pytest.skip(why)
    from tiny_models import converted_tiny_llama

    converted_tiny_llama(tmp_path / "ds")
    ids = torch.randint(0, 300, (TEXT_LEN,), generator=torch.Generator().manual_seed(2)).tolist()
    greedy, lp = _reference(tmp_path / "ds", ids)
    run = _run(tmp_path / "ds", ids)
    assert (run.layers[0]["kernel"], run.layers[0]["kv_cache_shape"][-1]) == ("torch", 32)
    assert run.greedy == greedy and len(set(greedy)) > 4
    assert max(abs(a - b) for a, b in zip(run.logprobs[1:], lp)) <= 1e-4
