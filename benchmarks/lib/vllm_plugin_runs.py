"""The runs of ``benchmarks/engines_vllm_plugin.py``: the models (124M shapes with random weights, trained tiny
checkpoints), their exports, one vLLM engine per model measured against transformers (exactness, cache tokens for a
budget, decode tokens/s at the largest batch) and the load average sampled while they run."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from kvsplice.convert.engines import vllm as vllm_engine

SHAPES = ("ds_mha", "ds_mla", "ds_mla_kvsplice_50", "ds_mla_kvsplice_90")
PAD = (512, 64)
SCORED, PROMPT = 96, 8
KEY = "median_decode_tok_s"
"""The decode rate compared: the full batch over the median decode step (the CPU is shared: bursts of other jobs
hit single steps)."""
BLOCK = 32
"""Cache block of the standard-attention model (vLLM's CPU attention takes multiples of 32; MLA gets 16)."""
ALL_STEPS = "decode_tok_s"
"""The other decode rate: tokens over the seconds of every decode step (any batch)."""
MAX_REPEATS = 20
SLACK = 2 * BLOCK
"""Tokens added to the KV budget over ``--mha-seqs`` full standard-attention sequences: vLLM keeps one block as its
null block and counts whole blocks."""


def bytes_per_token(cfg, dtype_bytes: int = 4) -> int:
    """The formula: MHA caches K and V (2 · d_model per layer), MLA its latent + RoPE key row."""
    row = 2 * cfg.n_head * cfg.head_size if cfg.attention == "mha" else cfg.d_cached_latent + cfg.qk_rope_head_dim
    return cfg.n_layer * row * dtype_bytes


def export(model, cfg, out: Path, pad: Optional[tuple[int, int]] = None) -> Path:
    from models.checkpoint import save_model
    from training import export as ex

    ckpt = save_model(model, out.with_suffix(".ckpt"))
    fmt = "auto" if cfg.attention == "mha" else "deepseek_v3"
    ex.export(ckpt, out, fmt=fmt, force=True, tokenizer=False,
              pad_latent=pad[0] if pad else None, pad_rope=pad[1] if pad else None)
    ckpt.unlink()
    return out


@torch.no_grad()
def reference(folder: Path, ids: list[int], new: int) -> tuple[list[int], list[float]]:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    logits = hf(torch.tensor([ids])).logits[0]  # (T, V)
    lp = torch.log_softmax(logits[:-1].double(), -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]  # (T-1,)
    g = hf.generate(torch.tensor([ids[:PROMPT]]), max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return g[0, PROMPT:].tolist(), lp.tolist()


def measure(name: str, folder: Path, ref_dir: Path, cfg, *, budget: int, context: int, new: int, plugin: bool,
            row_bytes: int) -> dict[str, Any]:
    vocab = cfg.vocab_size
    ids = torch.randint(0, vocab, (SCORED,), generator=torch.Generator().manual_seed(1)).tolist()
    greedy, lp = reference(ref_dir, ids, new)
    t0 = time.perf_counter()
    formula = budget // row_bytes
    if formula < context + 16:  # less than one full-length sequence (and vLLM's null block): vLLM refuses to start
        return {"model": name, "plugin": plugin, "kv_budget": budget, "row": None, "bytes_per_token_formula": row_bytes,
                "cache_tokens_formula": formula, "error": f"the budget holds {formula} tokens, under one {context}-"
                f"token sequence: vLLM does not start"}
    run = vllm_engine.run(folder, prompt=ids[:PROMPT], new=new, score=ids, others=[ids[40:90], ids[3:20], ids[:5]],
                          max_model_len=context, kv_cache_bytes=budget, plugin=plugin, max_num_seqs=1024,
                          block_size=BLOCK,
                          throughput={"seqs": 0, "prompt": context - new, "new": new}, timeout=3600)
    la = run.layers[0]
    return {"model": name, "plugin": plugin, "kv_budget": budget, "backend": la["backend"], "decode_kernel": la["kernel"],
            "row": la["kv_cache_shape"][-1], "bytes_per_token": run.kv_bytes_per_token,
            "bytes_per_token_formula": row_bytes, "cache_tokens_vllm": run.cache_tokens,
            "cache_tokens_formula": formula, "greedy_equal": run.greedy == greedy,
            "max_abs_logprob_diff": max(abs(a - b) for a, b in zip(run.logprobs[1:], lp)),
            "throughput": run.throughput, "seconds": time.perf_counter() - t0}


def models_124m(work: Path):
    from models import GPT
    from models.config import GPTConfig

    for name in SHAPES:
        torch.manual_seed(0)
        cfg = GPTConfig.from_name(name)
        model = GPT(cfg).eval()
        yield f"{name} (124M shapes, random)", cfg, model


def models_trained(ckpts: Sequence[Path]):
    from models.checkpoint import load_gpt_checkpoint

    for ckpt in ckpts:
        model, cfg, meta = load_gpt_checkpoint(ckpt)
        yield f"{cfg.variant} (tiny, {meta.get('global_step')} steps)", cfg, model.eval()


def one_run(a, progress) -> list[dict[str, Any]]:
    """Every model of ``a`` once in vLLM (fresh exports; the 124M weights seeded): its rows; ``progress(rows)``
    after each model (a run cut short keeps what it measured)."""
    from models.config import GPTConfig

    mha = GPTConfig.from_name("ds_mha")
    budget = (a.mha_seqs * a.context + SLACK) * bytes_per_token(mha)
    rows: list[dict[str, Any]] = []
    work = Path(tempfile.mkdtemp(prefix="vllm_plugin_bench_"))
    sources = [] if a.skip_124m else [(n, c, m, budget) for n, c, m in models_124m(work)
                                      if n.split(" ")[0] in a.shapes]
    for n, c, m in models_trained(a.trained):
        mha_bytes = c.n_layer * 2 * c.d_model * 4  # the same shapes' standard attention: K and V of d_model
        sources.append((n, c, m, (a.mha_seqs * min(a.context, c.block_size) + SLACK) * mha_bytes))
    try:
        for name, cfg, model, bud in sources:
            context = min(a.context, cfg.block_size)
            folder = export(model, cfg, work / "x")
            rows.append(measure(name, folder, folder, cfg, budget=bud, context=context, new=a.new, plugin=True,
                                row_bytes=bytes_per_token(cfg)))
            print(json.dumps(rows[-1]), file=sys.stderr)
            if cfg.attention == "mla" and "kvsplice_90" in cfg.variant:
                padded = export(model, cfg, work / "x_padded", PAD)
                rows.append(measure(name, padded, folder, cfg, budget=bud, context=context, new=a.new, plugin=False,
                                    row_bytes=cfg.n_layer * sum(PAD) * 4))
                print(json.dumps(rows[-1]), file=sys.stderr)
                shutil.rmtree(padded)
            shutil.rmtree(folder)
            del model
            progress(rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


class LoadSampler:
    """The 1-minute load average every ``every`` seconds while in its ``with`` block (the CPU is shared: the
    conditions a run was measured under)."""

    def __init__(self, every: float = 5.0) -> None:
        self.every, self.samples = every, [os.getloadavg()[0]]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.every)
        self.samples.append(os.getloadavg()[0])

    def summary(self) -> dict[str, float]:
        x = self.samples
        return {"mean": round(statistics.fmean(x), 2), "min": round(min(x), 2), "max": round(max(x), 2), "n": len(x)}
