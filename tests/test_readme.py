"""The front page and its results doc: README.md stays short, keeps the quick start CI runs, every relative link and
image in README.md / docs/results.md / docs/reference.md resolves to a file (and heading) in the repository, the
figure script runs on the committed results files, the README's headline numbers are the ones those files hold, and
the README's Python example runs."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from doc_links import LINK, anchors, broken_links, links
from tiny_models import load_benchmark

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, ROOT / "docs" / "results.md", ROOT / "docs" / "reference.md"]
QUICK_START = [
    'pip install torch==2.13.0 && pip install -e ".[dev]"',
    "python -m training.fit --config tiny_mla_kvsplice_90",
    "python -m pytest",
]


@pytest.fixture(scope="module")
def figure():
    return load_benchmark("readme_figure")


def test_readme_is_short():
    size = len(README.read_bytes())  # what `wc -c README.md` counts
    assert size <= 8000, f"README.md is {size} bytes; the front page stays <= 8,000 (move detail to docs/)"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc):
    """Every relative link and image target exists in the repository; a #fragment names a heading of its file."""
    assert links(doc), f"{doc.name}: no links found (the pattern broke?)"
    broken = broken_links(doc)
    assert not broken, f"{doc.relative_to(ROOT)}: broken links: {broken}"


def test_link_check_catches_a_broken_link(tmp_path):
    """The checker itself: a missing file and a missing heading are both found."""
    md = tmp_path / "x.md"
    md.write_text("# Title\n\n[a](missing.md) ![b](figures/none.png) [c](#title) [d](#nope) `[e](code.md)`\n")
    assert links(md) == ["missing.md", "figures/none.png", "#title", "#nope"]
    assert "title" in anchors(md) and "nope" not in anchors(md)


def test_readme_has_a_figure():
    images = [t for t in links(README) if LINK.search(f"![x]({t})") and t.endswith(".png")]
    assert images, "README.md shows no committed PNG"
    for image in images:
        assert (ROOT / image).is_file()


def test_quick_start_verbatim():
    """The three quick-start commands, in a ```bash block; CI (.ci/run) runs the README's test command."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    commands = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    for command in QUICK_START:
        assert command in commands, f"README.md lost the quick-start command {command!r}"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^python -m pytest$", ci, flags=re.M), "CI no longer runs `python -m pytest`"


def test_readme_names_the_markers():
    text = README.read_text(encoding="utf-8")
    assert "`pytest -m slow`" in text and "`gpu`" in text


@pytest.mark.parametrize("doc", DOCS[1:], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_doc_leads_with_a_table_or_figure(doc):
    first = next(line for line in doc.read_text(encoding="utf-8").splitlines() if line.strip() and
                 not line.startswith("#"))
    assert first.startswith(("|", "![")), f"{doc.name} opens with prose: {first[:80]!r}"


def test_every_figure_names_its_command():
    """Each image shown in the README / results doc is made by a command named in that doc."""
    for doc in DOCS[:2]:
        text = doc.read_text(encoding="utf-8")
        for target in links(doc):
            if target.endswith("figures/overview.png"):
                assert "python -m benchmarks.readme_figure" in text, doc.name


def test_figure_script_runs_on_the_committed_results(figure, tmp_path):
    out = tmp_path / "overview.png"
    assert figure.main(["--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    # the README shows the file this script writes by default
    assert figure.OUT.relative_to(ROOT).as_posix() in links(README)


def test_figure_script_as_a_command(tmp_path):
    out = tmp_path / "o.png"
    run = subprocess.run([sys.executable, "-m", "benchmarks.readme_figure", "--out", str(out)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert out.is_file()
    bad = subprocess.run([sys.executable, "-m", "benchmarks.readme_figure", "--results", str(tmp_path / "none"),
                          "--out", str(tmp_path / "p.png")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("readme_figure: error:")
    assert not (tmp_path / "p.png").exists()


def test_figure_data_and_readme_numbers(figure):
    """The points come from the results files, and the README's headline numbers are those points."""
    import json
    import statistics

    trained = {p["variant"]: p for p in figure.load_trained(ROOT / "results")}
    rows = json.loads((ROOT / "results" / "frontier_gpu.json").read_text())["rows"]
    mha = statistics.mean(r["val_loss"] for r in rows if r["variant"] == "mha")
    assert trained["mha"]["bytes"] == 2048 and trained["mha"]["loss"] == pytest.approx(mha)
    assert trained["mha"]["seeds"] == 3 and trained["insert90"]["bytes"] == 104
    post = {p["id"]: p for p in figure.load_post_training(ROOT / "results")}
    assert post["mixed_4x"]["ratio"] == pytest.approx(4, rel=0.05)
    assert post["exact_4x"]["ratio"] == pytest.approx(4, rel=0.05)
    assert post["exact_8x"]["ratio"] == pytest.approx(8, rel=0.05)
    readme = README.read_text(encoding="utf-8")
    assert f"{post['mixed_4x']['delta']:+.2f} % perplexity" in readme
    assert f"scores\n  {post['mixed_4x']['tasks']:.0f} %" in readme or f"{post['mixed_4x']['tasks']:.0f} % on" in readme
    assert f"scores {post['plan_4x']['tasks']:.0f} %" in readme
    assert f"({post['kivi4_r128']['delta']:+.2f} %)".replace("-", "−") in readme
    for variant, text in (("insert90", "reaches\n  {:.3f}× MHA"), ("mla_128_kvsplice_90", "from scratch {:.3f}×")):
        assert text.format(trained[variant]["loss"] / trained["mha"]["loss"]) in readme, text


def test_readme_python_example_runs():
    """The README's Python block, on a tiny random Llama (no download)."""
    import torch

    from tiny_models import tiny_family

    block = re.search(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S).group(1)
    model = tiny_family("llama")
    ids = torch.randint(3, 90, (1, 80), generator=torch.Generator().manual_seed(0))
    scope = {"model": model, "ids": ids}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["out"].shape[0] == 1 and 80 < scope["out"].shape[1] <= 80 + 32  # transformers' stops at EOS
