"""benchmarks/frontier.py's bookkeeping: cache measurement from a checkpoint, the Pareto front, seed statistics and
the late-loss-drop figure (the long study itself runs outside the test suite)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from models.checkpoint import save_model
from models.config import GPTConfig
from models.gpt import GPT

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "frontier.py"


@pytest.fixture(scope="module")
def frontier():
    spec = importlib.util.spec_from_file_location("frontier_script", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("kw, per_layer", [(dict(), 2 * 32), (dict(n_kv_head=1), 2 * 8),
                                           (dict(attention="mla", d_latent=12), 12),
                                           (dict(attention="mla", d_latent=12, kvsplice_ratio=0.5), 6)])
def test_cache_bytes_from_a_checkpoint(tmp_path: Path, frontier, kw, per_layer) -> None:
    model = GPT(GPTConfig(vocab_size=50, n_layer=3, n_head=4, d_model=32, block_size=64, **kw))
    ckpt = save_model(model, tmp_path / "m.ckpt")
    got = frontier.cache_bytes(ckpt, 40)
    assert got["cache_bytes_per_token"] == 3 * per_layer * 2  # fp16, all layers
    assert got["cache_bytes_per_token_fp32"] == 3 * per_layer * 4
    assert got["cache_dim"] == per_layer


def _row(variant: str, seed: int, loss: float, nbytes: float) -> dict:
    curve = [[s, 5.0 - s / 100] for s in range(20, 101, 20)]  # falls 0.2 per 20 steps
    return {"variant": variant, "seed": seed, "val_loss": loss, "cache_bytes_per_token": nbytes, "tokens": 1000,
            "train_loss_curve": curve}


def test_summary_pareto_and_spread(frontier) -> None:
    rows = [_row("mha", s, 3.0 + 0.1 * s, 2048) for s in (1, 2, 3)]
    rows += [_row("mla", s, 3.05, 512) for s in (1, 2, 3)]
    rows += [_row("mqa", s, 3.3, 512) for s in (1, 2, 3)]  # same bytes as mla, higher loss: dominated
    rows += [_row("tiny", s, 3.5, 64) for s in (1, 2)]
    summary = {s["variant"]: s for s in frontier.summarise(rows)}
    assert math.isclose(summary["mha"]["val_loss"], 3.2) and math.isclose(summary["mha"]["std"], 0.1)
    assert summary["mla"]["std"] == 0.0 and summary["tiny"]["n"] == 2
    assert [v for v, s in summary.items() if s["pareto"]] == ["mla", "tiny"]  # mha: mla is smaller and better
    assert math.isclose(summary["mla"]["late_drop"], 0.2)  # mean of step 80 minus mean of step 100
    table = frontier.table(list(summary.values()))
    assert "| mla | 512 | 0.250× | 3.0500 ± 0.0000 | 3 |" in table


def test_late_drop_flat_and_short_curves(frontier) -> None:
    assert frontier.late_drop([[s, 2.0] for s in range(10, 101, 10)]) == 0.0
    assert frontier.late_drop([]) is None and frontier.late_drop([[100, 2.0]]) is None


def test_last_val_and_curve_from_metrics(tmp_path: Path, frontier) -> None:
    m = tmp_path / "metrics.csv"
    m.write_text("epoch,lr,step,tokens,tokens_per_sec,train_loss,train_time_s,val_loss,val_ppl\n"
                 "0,0.1,19,40960.0,5000,6.1,8.0,,\n0,0.1,39,81920.0,5000,5.5,16.0,,\n0,,39,,,,,5.2,181.3\n")
    assert frontier.last_val(m) == (39, 5.2, 81920.0, 16.0)
    assert frontier.train_curve(m) == [[20, 6.1], [40, 5.5]]
    m.write_text("epoch,lr,step,tokens,tokens_per_sec,train_loss,train_time_s,val_loss,val_ppl\n0,,4,,,,,6.7,812.0\n")
    assert frontier.last_val(m) == (4, 6.7, None, None)  # shorter than the logging interval (short fine-tunes)
