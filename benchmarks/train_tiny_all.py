"""Train the five tiny configs back to back and tabulate final validation loss, perplexity and throughput.

    python -m benchmarks.train_tiny_all                       # all five, each with its config's max_steps
    python -m benchmarks.train_tiny_all --runs_dir /tmp/tiny  # elsewhere than checkpoints/
    python -m benchmarks.train_tiny_all -- --trainer.max_steps 100   # extra flags go to every run

Each run is ``python -m training.fit --config tiny_<variant> --runs_dir <runs_dir> --overwrite`` (fp32, CPU, offline synthetic
data). Reported per run, from its ``metrics.csv``: the last ``val_loss`` and ``val_ppl``, and throughput = training
tokens / training wall time (validation excluded), also relative to tiny_gpt2. The unigram entropy of the synthetic
training tokens (the loss of the best context-free predictor) is the reference a language model must beat. The
table is printed as Markdown and saved with the raw numbers to ``<runs_dir>/tiny_benchmark.json``.

Throughput on a shared machine is noisy: the 1-minute load average before and after each run is recorded too, and
a second, load-robust measure is added: the median time of one training step (forward + backward + AdamW on a
training-shaped batch) with the five models timed round-robin, so a change in machine load hits all of them alike.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import yaml


from benchmarks.harness.header import header
from benchmarks.harness.options import command, parser
from benchmarks.harness.paths import ROOT as REPO
from benchmarks.harness.timing import wall_time
VARIANTS = ["tiny_gpt2", "tiny_mla", "tiny_mla_kvsplice_50", "tiny_mla_kvsplice_70", "tiny_mla_kvsplice_90"]


def last(rows: list[dict[str, str]], key: str) -> tuple[int, float]:
    vals = [(int(r["step"]), float(r[key])) for r in rows if r.get(key)]
    if not vals:
        raise RuntimeError(f"metrics.csv has no {key!r} values")
    return vals[-1]


def unigram_entropy_of(config: Path, cache_dir: str | None) -> tuple[float, str, int]:
    from data import TinyStoriesDataModule

    d = dict(yaml.safe_load(config.read_text())["data"])
    d["block_size"] = yaml.safe_load(config.read_text())["model"]["block_size"]
    if cache_dir:
        d["cache_dir"] = cache_dir
    dm = TinyStoriesDataModule(**d)
    dm.prepare_data()
    return dm.unigram_entropy, dm.describe(), dm.vocab_size


def interleaved_step_ms(configs: list[Path], vocab_size: int, rounds: int, threads: int | None) -> list[float]:
    """Median ms per training step of each config's model, timing the models round-robin ``rounds`` times."""
    import torch

    from training.lit import LitGPT

    if threads:
        torch.set_num_threads(threads)
    steps = []
    for cfg_path in configs:
        cfg = yaml.safe_load(cfg_path.read_text())
        m = {k: v for k, v in cfg["model"].items()}
        torch.manual_seed(0)
        lit = LitGPT(vocab_size=vocab_size, **m)
        opt = torch.optim.AdamW(lit.parameters(), lr=1e-4)
        x = torch.randint(0, vocab_size, (cfg["data"]["batch_size"], m["block_size"] + 1))

        def step(lit=lit, opt=opt, x=x) -> None:
            loss, _ = lit._loss((x[:, :-1], x[:, 1:]))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        step()  # warm-up
        steps.append(step)
    times: list[list[float]] = [[] for _ in configs]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            times[i] += wall_time(step, 1)
    return [1000 * sorted(t)[len(t) // 2] for t in times]


@command
def main(argv=None) -> int:
    ap = parser(__file__, __doc__, raw=True)
    ap.add_argument("--runs_dir", default="checkpoints")
    ap.add_argument("--variants", nargs="*", default=VARIANTS)
    ap.add_argument("--rounds", type=int, default=20, help="round-robin rounds of the interleaved step timing")
    ap.add_argument("extra", nargs="*", help="flags passed to every training run (after --)")
    a = ap.parse_args(argv)
    runs_dir = Path(a.runs_dir)
    cache_dir = next((a.extra[i + 1] for i, x in enumerate(a.extra[:-1]) if x == "--data.cache_dir"), None)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    results = []
    for name in a.variants:
        cmd = [sys.executable, "-m", "training.fit", "--config", name, "--runs_dir", str(runs_dir), "--overwrite",
               "--trainer.enable_progress_bar", "false", *a.extra]  # --overwrite: the table reads <name>/metrics.csv
        load_before = os.getloadavg()[0]
        t0 = time.perf_counter()
        print(f"== {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.run(cmd, cwd=REPO, env=env)
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            print(f"{name}: training failed with exit code {proc.returncode}", file=sys.stderr)
            return proc.returncode
        run_dir = runs_dir / name
        with open(run_dir / "metrics.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        step, val_loss = last(rows, "val_loss")
        _, val_ppl = last(rows, "val_ppl")
        _, tokens = last(rows, "tokens")
        _, train_time = last(rows, "train_time_s")
        results.append(dict(config=name, steps=step + 1, val_loss=val_loss, val_ppl=val_ppl, tokens=tokens,
                            train_time_s=train_time, tokens_per_sec=tokens / train_time, wall_s=wall,
                            load_before=load_before, load_after=os.getloadavg()[0]))
        print(f"   {name}: val_loss {val_loss:.4f}, ppl {val_ppl:.2f}, {tokens / train_time:,.0f} tokens/s, "
              f"wall {wall:.0f} s", flush=True)

    h, desc, vocab = unigram_entropy_of(REPO / "configs" / f"{a.variants[0]}.yaml", cache_dir)
    threads = next((int(a.extra[i + 1]) for i, x in enumerate(a.extra[:-1]) if x == "--torch_threads"), None)
    step_ms = interleaved_step_ms([REPO / "configs" / f"{n}.yaml" for n in a.variants], vocab, a.rounds, threads)
    for r, ms in zip(results, step_ms):
        r["interleaved_step_ms"] = ms
    ref = next((r for r in results if r["config"] == "tiny_gpt2"), results[0])
    base, base_ms = ref["tokens_per_sec"], ref["interleaved_step_ms"]
    lines = [
        f"Data: {desc}",
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, fp32, "
        f"torch threads: {threads or 'default'}",
        "",
        "| config | steps | val loss (nats) | val ppl | tokens/s (run) | vs tiny_gpt2 | step ms (interleaved) | "
        "speed vs tiny_gpt2 (interleaved) | wall s | load avg before/after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(f"| {r['config']} | {r['steps']} | {r['val_loss']:.3f} | {r['val_ppl']:.2f} | "
                     f"{r['tokens_per_sec']:,.0f} | {r['tokens_per_sec'] / base:.2f}x | "
                     f"{r['interleaved_step_ms']:.0f} | {base_ms / r['interleaved_step_ms']:.2f}x | {r['wall_s']:.0f} | "
                     f"{r['load_before']:.1f}/{r['load_after']:.1f} |")
    lines.append(f"\nUnigram entropy of the training tokens: {h:.3f} nats (a context-free model's loss).")
    table = "\n".join(lines)
    print("\n" + table)
    runs_dir.mkdir(parents=True, exist_ok=True)
    (runs_dir / "tiny_benchmark.json").write_text(json.dumps({**header(__file__, argv, threads), "unigram_entropy": h,
                                                              "data": desc,
                                                              "runs": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
