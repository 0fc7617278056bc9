"""The loss-vs-cache-bytes frontier: MHA, GQA, MQA, MLA at three latent sizes, KVSplice 50/70/90 and the DeepSeek-V3
layout's variants (``ds_*``), trained at equal tokens on real TinyStories text, several seeds each.

    python -m benchmarks.frontier                    # the study: every variant x seeds 1 2 3 (--resume continues)
    python -m benchmarks.frontier --study ablation   # MLA options on a tuning split (seed 0), run before the study
    python -m benchmarks.frontier --plot-only --resume   # redraw the plot / table from the JSON

Every run is ``python -m training.fit --config small_<variant> --seed_everything S --trainer.max_steps N`` (fp32,
one thread per run, ``--jobs`` side by side); its last checkpoint then prefills a block through the model's real
decode cache (bytes per token, fp16 and fp32). ``--study ablation`` trains and validates on the training files only
(a held-out 5 % tail): the MLA option it picks is not tuned on the text the frontier reports. On a GPU: ``--device
cuda --batch 64 --steps 2000 --jobs 9`` (32.8M tokens per run) writes ``results/frontier_gpu.*``. Outputs:
``results/frontier.json`` (a row per run), ``.png`` (loss vs bytes, mean ± std, Pareto front) and ``.md``.
"""
from __future__ import annotations

import json

from benchmarks.harness.paths import RESULTS
from benchmarks.harness.runner import Study
from benchmarks.harness.studies import variants
from benchmarks.lib.seed_report import figure, report_rows
from benchmarks.lib.study import BOUNDS, gpu, options as study_options, run_one, train_rows

SECTIONS = {s: variants("frontier", s) for s in ("frontier", "ablation")}  # variant -> (config, overrides) (YAML)


def init_kv_rms() -> dict:
    """RMS of layer 0's queries, keys and values at init for unit-RMS inputs: MLA's keys/values (a product of two
    N(0, 0.02) maps) start several times smaller than MHA's unless the latent is normalised."""
    import torch

    from models.config import GPTConfig
    from models.gpt import GPT

    out = {}
    for label, name, kw in (("mha", "small_mha", {}), ("mla_64", "small_mla_64", {}),
                            ("mla_64+latent_norm", "small_mla_64", {"latent_norm": True}),
                            ("mla_128", "small_mla", {}), ("mla_128+latent_norm", "small_mla", {"latent_norm": True})):
        torch.manual_seed(0)
        model = GPT(GPTConfig.from_name(name, vocab_size=4096, latent_norm=kw.get("latent_norm", False)))
        attn = model.transformer.h[0].attn
        x = torch.randn(4, 64, model.cfg.d_model, generator=torch.Generator().manual_seed(1))  # (B, T, d), RMS 1
        with torch.no_grad():
            if model.cfg.attention == "mha":
                q, k, v = attn.c_attn(x).split(model.cfg.d_model, -1)
            else:
                c = attn._c(x)  # (B, T, d_latent)
                q, k, v = attn.w_q(x), attn.w_uk(c), attn.w_uv(c)
        out[label] = {n: round(float(t.pow(2).mean().sqrt()), 4) for n, t in (("q", q), ("k", k), ("v", v))}
    return out


def rows(run):
    if run.args.study == "ablation":
        rms = run.notes.setdefault("meta", {})["init_kv_rms"] = init_kv_rms()
        run.say(f"q/k/v RMS at init (layer 0, unit-RMS inputs): {json.dumps(rms)}")
    yield from train_rows(run, SECTIONS, {"frontier": [1, 2, 3], "ablation": [0]},
                          lambda v, seed, a, runs: run_one(v, seed, a, runs, *SECTIONS[a.study][v]))


STUDY = Study("frontier", __doc__, rows, figure=figure, bounds=BOUNDS,
              options=lambda p: study_options(p, ("frontier", "ablation"), "1 2 3 (frontier), 0 (ablation)",
                                              report="--plot-only"),
              out=lambda a: RESULTS / f"frontier{'' if a.study == 'frontier' else '_ablation'}{gpu(a)}",
              summary=lambda run, rows: {**run.notes, **report_rows(run, rows)})
main = STUDY.main

if __name__ == "__main__":
    raise SystemExit(main())
