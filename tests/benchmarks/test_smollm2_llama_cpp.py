"""benchmarks/smollm2_llama_cpp.py on the runner, without llama.cpp: ``--report-only --resume`` renders the report
from a run's rows (each type's cache of most cells, protocol P against llama.cpp's f16, each setting's task accuracy)
and an unknown cache type is one line before anything is written."""

from __future__ import annotations

import json

from tiny_models import load_benchmark


def rows() -> list[dict]:
    cache = dict(kind="cache", layers=30, k_type="q8_0", v_type="q8_0", formula_bytes_per_token=12240)
    task = dict(kind="task", task="passkey", length=1024, setting="agnostic", cpu_seconds=1.0)
    return [dict(cache, type="q8_0", cells=1280, bytes_per_token=12238.848),
            dict(cache, type="q8_0", cells=32768, bytes_per_token=12240.0),  # --exact-bytes: this one counts
            dict(cache, type="f16", cells=1280, bytes_per_token=23040.0, formula_bytes_per_token=23040),
            dict(kind="P", type="q8_0", ppl=7.5), dict(kind="P", type="f16", ppl=7.4),
            dict(task, type="q8_0", id="passkey/1024/0/agnostic", score=1.0),
            dict(task, type="q8_0", id="passkey/1024/1/agnostic", score=0.0),
            dict(kind="ours", spec="k8v4h", ppl=7.3, bytes_per_token=9540.0)]


def test_report_from_the_resumed_rows(tmp_path):
    bench = load_benchmark("smollm2_llama_cpp")
    (tmp_path / "r.json").write_text(json.dumps(dict(study="smollm2_llama_cpp", rows=rows())))
    assert bench.main(["--report-only", "--resume", "--force", "--out", str(tmp_path / "r")]) == 0
    res = json.loads((tmp_path / "r.json").read_text())
    assert len(res["rows"]) == len(rows())
    p = {r["label"]: r for r in res["protocol_P"]}
    assert p["llama.cpp `q8_0` K+V"]["cells"] == 32768 and p["ours: k8v4h"]["ppl"] == 7.3
    assert res["tasks"]["agnostic"]["llama.cpp `q8_0`"]["cells"] == {"passkey/1024": [50.0, 2]}
    md = (tmp_path / "r.md").read_text()
    assert "| llama.cpp `q8_0` K+V | 12,240.0 | yes | 12,240 (32,768 cells) | 1.88 | 7.5000 | +1.35 % |" in md
    table = md[md.index("## Tasks"):].splitlines()  # beside our committed task rows
    q8 = next(x for x in table if x.startswith("| agnostic | llama.cpp `q8_0` |"))
    assert q8.endswith("| **50.0** | 12,240 | passkey/1024: 50 (2) |") and "| agnostic | ours: full K/V |" in md

def test_unknown_cache_type_is_one_line(tmp_path, capsys):
    bench = load_benchmark("smollm2_llama_cpp")
    assert bench.main(["--types", "q3_x", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("smollm2_llama_cpp: error: unknown llama.cpp KV cache type 'q3_x'") and "\n" not in err
    assert not list(tmp_path.iterdir())
