"""kvsplice.tasks.report: accuracy summaries, and the rows beyond the model (the full cache under REACH %)."""

from kvsplice.tasks.report import REACH, markdown, summarize


def _outcome(score: float, fp16: int = 100) -> dict:
    return {"score": score, "fp16_bytes": fp16, "n_compressed": 10, "full_fp16_bytes": 400, "cache_bytes": fp16,
            "seconds": 1.0, "cpu_seconds": 2.0}


def _results() -> dict:
    """passkey/2048: the full cache answers 1 of 2 (beyond); niah/1024: 2 of 2 (within reach)."""
    by_inst = {
        "passkey/2048/0": {"full": _outcome(1.0, 400), "int8": _outcome(1.0)},
        "passkey/2048/1": {"full": _outcome(0.0, 400), "int8": _outcome(0.0)},
        "niah/1024/0": {"full": _outcome(1.0, 400), "int8": _outcome(1.0)},
        "niah/1024/1": {"full": _outcome(1.0, 400), "int8": _outcome(0.0)},
    }
    return {"agnostic": by_inst}


def test_summarize_marks_rows_beyond_the_model():
    per = summarize(_results(), ["full", "int8"])["agnostic"]
    assert per["full"]["cells"]["passkey/2048"] == {"acc": 50.0, "n": 2, "beyond": True}
    assert per["int8"]["cells"]["passkey/2048"]["beyond"] and not per["int8"]["cells"]["niah/1024"]["beyond"]
    assert per["int8"]["acc"] == 50.0  # all four instances
    assert per["int8"]["acc_within"] == 50.0 and per["full"]["acc_within"] == 100.0  # niah only
    assert per["int8"]["ratio"] == 4.0


def test_summarize_without_the_full_cache_marks_nothing():
    per = summarize(_results(), ["int8"])["agnostic"]
    assert not any(c["beyond"] for c in per["int8"]["cells"].values())
    assert per["int8"]["acc_within"] == per["int8"]["acc"]


def test_markdown_flags_rows_beyond_the_model():
    text = markdown(summarize(_results(), ["full", "int8"]), {"int8": "int8"})
    assert "| passkey/2048 † |" in text and "| niah/1024 |" in text
    assert "mean within reach" in text and f"< {REACH:.0f} %" in text
    plain = markdown(summarize(_results(), ["int8"]), {})
    assert "†" not in plain and "within reach" not in plain
