"""SmolLM2 converted to MLA (shared RoPE, 2x cache) and exported as DeepSeek-V3: the same model in our decoder,
transformers, llama.cpp (its converter + our q_lora_rank post-step) and vLLM: perplexity, greedy tokens, cache bytes.
``python -m benchmarks.engines_smollm2 [--model RUN/model --tag tuned]`` (results/engines_smollm2[_tuned].*).

Rows: the source (transformers, fp32), the norm-free conversion (or ``--model DIR``), its export in transformers,
llama.cpp (f32 / bf16 / f16 GGUF, f16 KV cache), vLLM's plugin, a real latent RMSNorm (``--latent-norm``: unusable).
Calibration: TinyStoriesV2's first ``--calib-tokens``; evaluation: one window of the TinyStories train sample, no BOS.
"""

from __future__ import annotations

from pathlib import Path

import torch

from benchmarks.harness.paths import DATA
from benchmarks.harness.runner import Study
from benchmarks.lib.engines import ppl
from kvsplice.convert.engines.llama_cpp import LlamaCppModel, missing


def options(p) -> None:
    p.add_argument("--gguf", default=str(DATA / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--calib", default=str(DATA / "tinystories" / "mines-opt-ml_decoding-gpt__tinystories_10k.txt"))
    p.add_argument("--eval", default=str(DATA / "tinystories" / "gusjengis_toy-RNN__tinystories_sample.txt"))
    p.add_argument("--calib-tokens", dest="calib_tokens", type=int)
    p.add_argument("--eval-tokens", dest="eval_tokens", type=int)
    p.add_argument("--d-latent", dest="d_latent", type=int)
    p.add_argument("--greedy", type=int)
    p.add_argument("--work", default="/tmp/engines_smollm2")
    p.add_argument("--skip-normed", action="store_true", help="leave out the --latent-norm row")
    p.add_argument("--model", default=None, help="a converted native MLA folder to export (default: convert here)")


def rows(run):
    import transformers

    from kvsplice.convert.deepseek_v3 import save_deepseek_v3
    from kvsplice.convert.engines import vllm
    from kvsplice.convert.engines.gguf_convert import hf_to_gguf
    from kvsplice.convert.llama_mla import calibrate_layers, convert_llama
    from kvsplice.loading import iter_texts, load_model, token_stream
    from kvsplice.lowrank.calibrate import calibration_batches

    args, d_latent, n_greedy = run.args, run["d_latent"], run["greedy"]
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    loaded = load_model(args.gguf)
    src, tok = loaded.model.float().eval(), loaded.tokenizer
    ev, _ = token_stream(iter_texts(args.eval), tok, run["eval_tokens"])
    cal, _ = token_stream(iter_texts(args.calib), tok, run["calib_tokens"])
    prompt = list(tok.encode("Once upon a time"))

    @torch.no_grad()
    def torch_row(name, m, kv_bytes=None):
        out = m(ev[None])
        lg = (out.logits if hasattr(out, "logits") else out)[0]
        g = torch.tensor([prompt])
        for _ in range(n_greedy):  # plain greedy, full forward each step (small)
            o = m(g)
            g = torch.cat([g, (o.logits if hasattr(o, "logits") else o)[:, -1:].argmax(-1)], 1)
        new = g[0, len(prompt):].tolist()
        row = {"name": name, "ppl": ppl(lg, ev), "greedy": new, "kv_bytes_per_token": kv_bytes,
               "greedy_text": tok.backend.decode(new)}
        run.say(f"{name}: ppl {row['ppl']:.3f}")
        return row

    yield torch_row("source (transformers, fp32)", src, kv_bytes=30 * 2 * 3 * 64 * 2)  # 30 layers x (K, V) x 3 x 64 x f16
    if args.model:
        mla = load_model(args.model).model.float().eval()
        name = f"ours: {Path(args.model).name} (R={mla.cfg.d_latent} + {mla.cfg.rope_dims} RoPE)"
    else:
        stats = calibrate_layers(src, calibration_batches(cal, 1024, 4))
        mla = convert_llama(src, stats, d_latent=d_latent, rope_dims=64, layout="shared")
        name = f"ours: MLA R={d_latent} + 64 RoPE, norm-free"
    yield torch_row(name, mla, kv_bytes=mla.cache_bytes_formula(1, 1, torch.float16))
    ds_dir = work / "dsv3"
    save_deepseek_v3(mla, ds_dir, tok.backend)
    ds = transformers.AutoModelForCausalLM.from_pretrained(ds_dir, dtype=torch.float32).eval()
    yield torch_row("DeepSeek-V3 export (linear-regime latent norm) in transformers, fp32", ds)
    del ds
    if missing(bindings=True) is None:
        for outtype in ("f32", "bf16", "f16"):
            g = work / f"dsv3-{outtype}.gguf"
            added = hf_to_gguf(ds_dir, g, outtype=outtype)
            with LlamaCppModel(g, n_ctx=run["eval_tokens"], cache_type="f16") as lm:
                lp, new = ppl(lm.logits(ev.tolist()), ev), lm.greedy(prompt, n_greedy)
                row = {"name": f"same export in llama.cpp ({outtype} GGUF, f16 KV cache)", "ppl": lp, "greedy": new,
                       "kv_bytes_per_token": lm.kv_bytes_per_token, "kv_cache": lm.kv_cache(),
                       "post_step_added": added, "greedy_text": tok.backend.decode(new)}
            run.say(f"{row['name']}: ppl {row['ppl']:.3f}, {row['kv_bytes_per_token']} B / token, added {added}")
            yield row
    if vllm.missing() is None:  # the plugin's latent cache, fp32 (4 bytes a number)
        v = vllm.run(ds_dir, prompt=prompt, new=n_greedy, score=ev.tolist(), max_model_len=len(ev) + 8)
        yield {"name": f"same export in vLLM {v.version} (plugin, {v.backend}, fp32 KV cache)", "ppl": v.perplexity,
               "greedy": v.greedy, "kv_bytes_per_token": v.kv_bytes_per_token, "element_size": 4,
               "kv_cache": v.layers[0], "greedy_text": tok.backend.decode(v.greedy)}
    if not args.skip_normed and not args.model:
        normed = convert_llama(src, stats, d_latent=d_latent, rope_dims=64, layout="shared", latent_norm=True)
        yield torch_row(f"--latent-norm: MLA R={d_latent} + 64 RoPE with a real latent RMSNorm (before)", normed)


def summary(run, rows) -> dict:
    """Each row's greedy tokens against ours (the second row); llama.cpp's absence, when absent."""
    for r in rows:
        r["greedy_equal_to_ours"] = r["greedy"] == rows[1]["greedy"]
        if "kv_cache" in r:  # an engine's measured cache against our formula (f16: 2 bytes a number)
            r["kv_bytes_equal_formula"] = r["kv_bytes_per_token"] * 2 == rows[1]["kv_bytes_per_token"] * \
                r.get("element_size", 2)
    why = missing(bindings=True)
    return {"llama_cpp": why} if why else {}


STUDY = Study("engines_smollm2", __doc__, rows, options=options, summary=summary,
              bounds={"calib_tokens": (1024, 1 << 20), "eval_tokens": (2, 8192), "d_latent": (1, 576),
                      "greedy": (1, 1024)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
