"""What ``benchmarks/train_tiny_all.py`` measures beside the runs: the unigram entropy of a config's training tokens
(the loss of the best context-free predictor) and each config's training step timed round-robin with the others
(a change in machine load hits all of them alike)."""

from __future__ import annotations

from pathlib import Path

import yaml

from benchmarks.harness.timing import wall_time

__all__ = ["interleaved_step_ms", "unigram_entropy_of"]


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
