"""benchmarks/train_tiny_all.py on one tiny config, a run shorter than its logging interval: the row holds the tokens
it trained (its checkpoint's count: its metrics log none), its validation loss and perplexity, and the table."""

from __future__ import annotations

import json
import math

from tiny_models import load_benchmark


def test_a_run_shorter_than_the_log_interval_is_reported(tmp_path, data_cache, offline):
    bench = load_benchmark("train_tiny_all")
    argv = ["--smoke", "--variants", "tiny_gpt2", "--runs_dir", str(tmp_path / "runs"), "--out", str(tmp_path / "t"),
            "--", "--trainer.max_steps", "3", "--trainer.log_every_n_steps", "50", "--data.val_batches", "2",
            "--data.cache_dir", str(data_cache), "--torch_threads", "1"]
    assert bench.main(argv) == 0  # failed: "metrics.csv has no 'tokens' values"
    data = json.loads((tmp_path / "t.json").read_text())
    (row,) = data["rows"]
    assert row["config"] == "tiny_gpt2" and row["steps"] == 3 and row["tokens"] > 0
    assert math.isclose(row["val_ppl"], math.exp(row["val_loss"])) and row["interleaved_step_ms"] > 0
    md = (tmp_path / "t.md").read_text()
    assert data["unigram_entropy"] > 0 and "| tiny_gpt2 | 3 |" in md and "| 1.00x |" in md
    assert "Unigram entropy of the training tokens:" in md and "torch threads: 1" in md
