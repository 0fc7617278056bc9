"""The benchmark harness (``benchmarks/harness``) and the rules it exists for: every benchmark script builds its parser
through it (one-line errors, exit 2), none rebuilds its command line or edits ``sys.path`` itself, every script runs
as ``python -m benchmarks.X`` (no ``sys.path`` bootstrap); no module of the installable packages exists only
for the benchmarks; the header, timers, results writer, shared-data paths and study settings do what they say."""

from __future__ import annotations

import ast
import json
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.harness.runner import Study
from kvsplice.io.cli import run_cli
from tiny_models import load_benchmark

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCH.glob("*.py") if not p.name.startswith("_"))
PENDING_PORT: set[str] = set()
"""Scripts not yet on the harness (being extended elsewhere): each must still build its own parser, so that this
list empties as they are ported (the test below fails for an entry that no longer needs it)."""
LIBRARY = ("models", "kvsplice", "training", "data")
KEPT = {"kvsplice.convert.engines.vllm": "the vLLM engine runner, the sibling of kvsplice.convert.engines.llama_cpp "
                                         "(an engine the exports run in; its worker is run by path)"}
"""Library modules only a benchmark imports that stay in the library: the library's own API nonetheless (with the
reason), or a module only a script of :data:`PENDING_PORT` still imports (the script's name: the entry goes when it
is ported)."""


# ------------------------------------------------------------------------------------------ what scripts may do
def _own_parsers(tree: ast.AST) -> list[str]:
    """What in ``tree`` builds a parser by hand or edits ``sys.path`` / reads ``sys.argv`` (the harness's jobs)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("ArgumentParser", "Parser"):
                found.append(f"line {node.lineno}: {name}(...)")
            if (isinstance(f, ast.Attribute) and f.attr in ("insert", "append") and isinstance(f.value, ast.Attribute)
                    and f.value.attr == "path" and isinstance(f.value.value, ast.Name) and f.value.value.id == "sys"):
                found.append(f"line {node.lineno}: sys.path.{f.attr}")
        elif isinstance(node, ast.ClassDef):
            found += [f"line {node.lineno}: class {node.name}({ast.unparse(b)})" for b in node.bases
                      if ast.unparse(b).endswith("ArgumentParser")]
        elif (isinstance(node, ast.Attribute) and node.attr == "argv" and isinstance(node.value, ast.Name)
              and node.value.id == "sys"):
            found.append(f"line {node.lineno}: sys.argv")
    return found


def test_the_parser_checker_finds_a_hand_built_parser():
    src = ("import argparse, sys\nsys.path.insert(0, 'x')\np = argparse.ArgumentParser()\n"
           "class P(argparse.ArgumentParser): pass\ncmd = ' '.join(sys.argv)\n")
    assert sorted(x.split(": ", 1)[1] for x in _own_parsers(ast.parse(src))) == [
        "ArgumentParser(...)", "class P(argparse.ArgumentParser)", "sys.argv", "sys.path.insert"]
    assert _own_parsers(ast.parse("from benchmarks.harness.options import parser\np = parser(__file__, __doc__)\n")) \
        == []


def test_benchmark_parsers_are_built_in_one_place():
    """Outside ``benchmarks/harness/``, no benchmark file builds
    an argparse parser, edits ``sys.path`` or rebuilds its command line from ``sys.argv``."""
    offenders = {}
    for path in sorted(BENCH.rglob("*.py")):
        rel = path.relative_to(BENCH)
        if rel.parts[0] == "harness" or path.stem in PENDING_PORT:
            continue
        found = _own_parsers(ast.parse(path.read_text(), str(path)))
        if found:
            offenders[str(rel)] = found
    assert not offenders, offenders
    for name in sorted(PENDING_PORT):
        assert _own_parsers(ast.parse((BENCH / f"{name}.py").read_text())), \
            f"benchmarks/{name}.py is on the harness now: take it off PENDING_PORT"


def test_a_script_that_records_its_command_records_the_revision():
    """The command in a result comes from :func:`benchmarks.harness.header.command`, with the revision beside it
    (or the whole :func:`~benchmarks.harness.header.header`)."""
    lacking = []
    for name in SCRIPTS:
        text = (BENCH / f"{name}.py").read_text()
        if name not in PENDING_PORT and "command_line(" in text and "revision()" not in text:
            lacking.append(name)
    assert not lacking, lacking


@pytest.mark.parametrize("name", [s for s in SCRIPTS if s not in PENDING_PORT])
def test_every_script_answers_help_and_a_bad_option_in_one_line(name, capsys):
    bench = load_benchmark(name)
    assert bench.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: {name} "), out[:200]
    assert bench.main(["--no-such-option"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"{name}: error: "), err  # unknown option / a required one missing


def test_scripts_run_as_modules_without_a_path_bootstrap():
    """``python -m benchmarks.X`` is the one way in: no script edits ``sys.path`` or imports a bootstrap, and no
    ``# noqa: E402`` marks imports pushed below one."""
    offenders = {}
    for path in sorted(BENCH.rglob("*.py")):
        text = path.read_text()
        found = [w for w in ("import _root", "noqa: E402", "python benchmarks/") if w in text]
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert not offenders, offenders
    assert not (BENCH / "_root.py").exists()


def test_a_script_runs_as_a_module(tmp_path):
    """``python -m benchmarks.X`` from the repository runs this checkout's code: a bad option is one line, exit 2,
    nothing written."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "PYTHONPATH"}
    code = "import benchmarks.harness.paths as p, kvsplice; print(p.ROOT); print(kvsplice.__file__)"
    res = subprocess.run([sys.executable, "-m", "benchmarks.readme_figure", "--results", str(tmp_path / "none"),
                          "--out", str(tmp_path / "o.png")], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert res.returncode == 2 and res.stderr.startswith("readme_figure: error:"), res.stderr[-2000:]
    assert len(res.stderr.strip().splitlines()) == 1 and not (tmp_path / "o.png").exists()
    where = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env,
                           timeout=300)
    root, kv = where.stdout.split()
    assert Path(root) == ROOT and Path(kv).is_relative_to(ROOT), where.stdout


# ------------------------------------------------------------------------ no benchmark-only code in the library
def _modules(root: Path, packages) -> dict[str, Path]:
    out = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, known: dict[str, Path], own: str) -> set[str]:
    """The modules of ``known`` that ``path`` (module ``own``) imports anywhere in its body, and those it names as a
    string constant outside docstrings (registries import by name)."""
    tree = ast.parse(path.read_text(), str(path))
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    names = []
    is_pkg = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = own.split(".") if is_pkg else own.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names += [f"{base}.{a.name}" for a in node.names] + [base]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            names.append(node.value)
    return {n for n in names if n in known and n != own}


def benchmark_only(root: Path, library=LIBRARY, benchmarks: str = "benchmarks") -> dict[str, list[str]]:
    """Library modules the benchmarks import that nothing in the library imports (or names, for a registry), that are
    not a package's ``__init__`` and not a command (:func:`_is_command`): module → the benchmark files
    importing it."""
    lib = _modules(root, library)
    used = set()
    for mod, path in lib.items():
        used |= _imports(path, lib, mod)
    by_bench: dict[str, list[str]] = {}
    for path in sorted((root / benchmarks).rglob("*.py")):
        for m in _imports(path, lib, ""):
            by_bench.setdefault(m, []).append(str(path.relative_to(root)))
    return {m: files for m, files in by_bench.items()
            if m not in used and lib[m].name != "__init__.py" and not _is_command(lib[m].read_text())}


def _is_command(text: str) -> bool:
    """A module run as a program: ``if __name__ == "__main__"``, or a command's ``python -m`` shim."""
    return "__main__" in text or "shim(__name__" in text


def test_the_benchmark_only_checker_finds_such_a_module(tmp_path):
    for rel, text in {"lib/__init__.py": "", "lib/core.py": "X = 1\n", "lib/used.py": "from lib.core import X\n",
                      "lib/only_bench.py": "Y = 2\n", "lib/cli.py": "if __name__ == '__main__':\n    pass\n",
                      "lib/shim.py": "from lib.main import shim\nmain = shim(__name__, 'verb')\n",
                      "lib/registry.py": "NAMES = ['lib.by_name']\n", "lib/by_name.py": "Z = 3\n",
                      "bench/a.py": "import lib.only_bench, lib.core, lib.cli, lib.by_name\nfrom lib import used\n"
                                    "RUN = ['-m', 'lib.shim']\n"
                      }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert benchmark_only(tmp_path, ("lib",), "bench") == {"lib.only_bench": ["bench/a.py"], "lib.used": ["bench/a.py"]}


def test_no_module_of_the_installable_packages_exists_only_for_the_benchmarks():
    found = benchmark_only(ROOT)
    for m, why in KEPT.items():
        assert m in _modules(ROOT, LIBRARY), f"{m} is gone: take it off KEPT"
        if why in PENDING_PORT:
            assert found.get(m) == [f"benchmarks/{why}.py"], f"{m}: only benchmarks/{why}.py may import it ({found.get(m)})"
    assert not {m: f for m, f in found.items() if m not in KEPT}, "move these into benchmarks/lib/"


def test_benchmarks_are_not_installed():
    import tomllib

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(pattern.startswith("benchmarks") for pattern in include)


# -------------------------------------------------------------------------------------------------- the harness
def test_options_share_one_declaration_and_one_line_errors(capsys):
    from benchmarks.harness import options as o

    p = o.parser(str(BENCH / "study.py"), "First paragraph\nstill first.\n\nSecond.")
    o.add_threads(p)
    o.add_model(p, Path("m"))
    o.add_progress(p)
    o.add_device_dtype(p)
    a = p.parse_args([])
    assert (a.threads, a.model, a.progress, a.device, a.dtype) == (1, "m", True, None, "fp32")
    assert p.prog == "study" and p.description == "First paragraph\nstill first."
    assert p.parse_args(["--threads", "3", "--no-progress"]).progress is False
    assert run_cli("study", lambda: p.parse_args(["--threads", "0"]) and 0) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["study: error: argument --threads: must be >= 1, got 0"]


def test_a_command_interrupted_is_one_line_and_exit_130(tmp_path, capsys):
    def rows(run):
        raise KeyboardInterrupt
        yield {}

    assert Study("toy", "A toy.", rows).main(["--out", str(tmp_path / "toy")]) == 130
    assert capsys.readouterr().err == "toy: interrupted\n"


def test_the_header_names_the_command_machine_and_revision():
    from benchmarks.harness import header

    cmd = header.command(str(BENCH / "smollm2_speed.py"), ["--tag", "a b", "--contexts", "64"])
    assert cmd == "python -m benchmarks.smollm2_speed --tag 'a b' --contexts 64"
    assert shlex.split(cmd)[4] == "a b"
    h = header.header(str(BENCH / "x.py"), [], threads=1)
    assert set(h) == {"command", "machine", "revision"} and h["command"] == "python -m benchmarks.x"
    assert h["machine"]["cores"] >= 1 and h["machine"]["threads"] == 1 and h["machine"]["torch"] == torch.__version__
    rev = header.revision()
    if (ROOT / ".git").exists():
        assert rev is not None and all(c in "0123456789abcdef" for c in rev.removesuffix("+dirty")), rev
    line = header.machine_line(1)
    assert f"{h['machine']['cores']} cores" in line and "1 torch thread(s)" in line


def test_timers_take_the_median_after_the_warmup():
    from benchmarks.harness import timing

    calls = []
    samples = iter([5.0, 1.0, 3.0])

    def fake_timer(fn, n):
        return [(fn(), next(samples))[1] for _ in range(n)]

    assert timing.median_of(fake_timer, lambda: calls.append(1), 3, warmup=2) == 3.0
    assert len(calls) == 5  # two untimed, three timed
    x = torch.randn(64, 64)
    wall = timing.wall_time(lambda: x @ x, 4)
    assert len(wall) == 4 and all(t >= 0 for t in wall)
    assert statistics.median(wall) == timing.median_of(lambda fn, n: wall, lambda: None, 4)


def test_sampled_reads_at_the_start_while_running_and_at_the_end():
    import time

    from benchmarks.harness import timing

    count = iter(range(10_000))
    with timing.sampled(lambda: next(count), 0.02) as got:
        time.sleep(0.2)
        seen = len(got)
    assert seen >= 2 and len(got) > seen  # the start, some while running, one more as the block ended
    assert got == list(range(len(got)))  # in order


def test_portable_names_paths_as_the_repository_does():
    from benchmarks.harness.paths import DATA, ROOT, portable

    cmd = f"kvsplice plan --model {DATA}/smollm2-135m-instruct --out {ROOT}/checkpoints/p.json --cwd {ROOT}"
    assert portable(cmd) == ("kvsplice plan --model ../shared/data/smollm2-135m-instruct "
                             "--out checkpoints/p.json --cwd .")
    assert portable(f"{ROOT}2/x") == f"{ROOT}2/x"  # another folder whose name starts the same is not the repository
    assert portable({f"plan:{ROOT}/a.json": [f"{DATA}", 3, None]}) == {"plan:a.json": ["../shared/data", 3, None]}


def test_the_runner_names_a_study_by_tag_and_writes_no_path_of_this_machine(tmp_path):
    from benchmarks.harness.paths import ROOT, RESULTS
    from benchmarks.harness.runner import Study

    seen = []
    study = Study("study", None, lambda run: iter([{"plan": f"{ROOT}/checkpoints/p.json"}]), threads=None,
                  out=lambda args: seen.append(args) or tmp_path / "r" / "study",
                  markdown=lambda run, rows: f"`{rows[0]['plan']}`", sizes={"default": {}})
    assert Study("smollm2_speed", None, lambda run: iter(())).files(RESULTS / "smollm2_speed")[0] == \
        RESULTS / "smollm2_speed.json"
    assert study.main(["--tag", "2k"]) == 0 and len(seen) == 1
    data = json.loads((tmp_path / "r" / "study_2k.json").read_text())  # a results file names no path of this machine
    assert data["rows"] == [{"plan": "checkpoints/p.json"}] and str(ROOT) not in json.dumps(data)
    assert (tmp_path / "r" / "study_2k.md").read_text().startswith("`checkpoints/p.json`\n")
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["study_2k.json", "study_2k.md"]


def test_the_shared_data_is_beside_the_checkout():
    from benchmarks.harness import paths

    assert paths.ROOT == ROOT and paths.DATA == ROOT.parent / "shared" / "data"
    assert paths.SMOLLM2.parent == paths.STORIES.parent == paths.TINYSTORIES.parent == paths.DATA
    assert paths.CALIB.parent == paths.EVAL.parent == paths.TINYSTORIES


def test_study_settings_come_from_yaml(tmp_path, monkeypatch):
    from benchmarks.harness import studies

    smollm2 = load_benchmark("smollm2_tasks")
    cfg = studies.load("smollm2_tasks")
    assert smollm2.SIZES is cfg["sizes"] and smollm2.PLANNED is cfg["planned"]
    for name, size in cfg["sizes"].items():  # every size names what the study needs, every plan is planned
        assert {"methods", "tasks", "lengths", "n"} <= set(size), name
        assert set(smollm2.plans_of(size)) <= set(cfg["planned"]), name
        assert all(isinstance(x, str) for x in [*size["methods"], *size["tasks"]]), name
    assert cfg["planned"]["4x8kfit"] == [*cfg["planned"]["4x8kfb"], "--fit-length", "8000"]
    argv = smollm2.plan_argv("4x")
    assert argv[argv.index("--ratio") + 1] == "4"
    monkeypatch.setattr(studies, "STUDIES", tmp_path)
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(ValueError, match="a mapping"):
        studies.load("bad")
    with pytest.raises(OSError):
        studies.load("absent")


@pytest.mark.parametrize("study, sections", [("frontier", ("frontier", "ablation")),
                                             ("kvsplice_recipe", ("ablation", "recipe"))])
def test_training_studies_name_existing_configs(study, sections):
    """A training study's variants (YAML) each name a training config that exists and options of training.fit."""
    from benchmarks.harness.studies import variants

    bench = load_benchmark(study)
    for section in sections:
        vs = variants(study, section)
        assert vs and all((ROOT / "configs" / f"{config}.yaml").is_file() for config, _ in vs.values()), section
        assert all(all(isinstance(o, str) for o in opts) and all(o.startswith("--model.") for o in opts[::2])
                   for _, opts in vs.values()), section
    assert bench.SECTIONS["ablation"] == variants(study, "ablation")


def test_the_harness_options_import_no_torch(tmp_path):
    """A script's parser, ``--help`` and a bad option's line need no torch (``benchmarks/gpu_check.py --dry-run``
    runs where torch cannot be imported)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\nclass _Block:\n    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'triton'):\n            raise ImportError(f'blocked: {name}')\n"
        "sys.meta_path.insert(0, _Block())\n")
    env = {**__import__("os").environ, "PYTHONPATH": f"{site}{__import__('os').pathsep}{ROOT}"}
    code = ("from benchmarks.harness import options as o, header, paths, studies\n"
            "from kvsplice.io.cli import run_cli\n"
            "p = o.parser('x.py', 'doc'); o.add_threads(p); o.add_model(p, 'm')\n"
            "o.add_progress(p); o.add_device_dtype(p)\n"
            "main = lambda argv: run_cli('x', lambda: p.parse_args(argv) and 0)\n"
            "print(p.parse_args(['--threads', '2']).threads, main(['--bad']), header.machine()['cores'] > 0)\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["2", "2", "True"] and "error: unrecognized arguments: --bad" in res.stderr
