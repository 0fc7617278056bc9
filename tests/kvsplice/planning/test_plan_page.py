"""docs/plan.md's option table states the defaults ``kvsplice plan`` has: every numeric default in the table is the
parser's (a default changed in the code and not on the page fails here)."""

from __future__ import annotations

import re
from pathlib import Path

from kvsplice.cli.plan import build_parser

PAGE = Path(__file__).resolve().parents[3] / "docs" / "plan.md"


def _cells(row: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def numeric_defaults(text: str) -> dict[str, float]:
    """``--option`` → its numeric default, from the page's ``| option | default | what |`` table: a row's options and
    its comma-separated defaults pair up from the right (a required option leads a row without a default)."""
    rows = [r for r in text.splitlines() if r.startswith("| `--")]
    out: dict[str, float] = {}
    for row in rows:
        names, defaults = _cells(row)[:2]
        opts = re.findall(r"`(--[a-z0-9-]+)", names)
        vals = [v.strip() for v in re.split(r",\s(?=\S)", defaults)]
        for opt, val in zip(reversed(opts), reversed(vals)):
            if re.fullmatch(r"\d[\d,]*(\.\d+)?", val):
                out[opt] = float(val.replace(",", ""))
    return out


def test_numeric_defaults_reads_a_row():
    row = "| `--seq-len`, `--prompt-len`, `--tune-tokens` | 1024, 3/4 of it, 2,048 | windows |\n" \
          "| `--calib TEXT`, `--calib-tokens` | 16,384 | text |"
    assert numeric_defaults(row) == {"--seq-len": 1024, "--tune-tokens": 2048, "--calib-tokens": 16384}


def test_plan_page_states_the_parsers_numeric_defaults():
    documented = numeric_defaults(PAGE.read_text())
    assert {"--calib-tokens", "--tune-tokens", "--tune-n"} <= set(documented)
    assert "| `--seq-len`, `--prompt-len`, `--tune-tokens` | the model's positions at most 1024," in PAGE.read_text()
    parser = build_parser()
    actual = {opt: parser.get_default(opt[2:].replace("-", "_")) for opt in documented}
    wrong = {k: (v, actual[k]) for k, v in documented.items() if actual[k] != v}
    assert not wrong, f"docs/plan.md default vs the parser's: {wrong}"
