"""Tests of resuming ``eval_tasks --out`` (:mod:`kvsplice.tasks.resume`, :mod:`kvsplice.tasks.results_schema`,
:mod:`kvsplice.tasks.provenance`) on stories260K: a rerun with another computation (stories, door, dtype) or fewer
instances (seeds, tasks, lengths, settings) is refused in one line naming the option, one that adds instances runs
only the new ones under a header that describes them all, and a hand-edited file is refused, never half-trusted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hostile import one_error, run_tool, s260k  # noqa: F401  (s260k: a fixture)
from kvsplice.cli import eval_tasks

DATA = Path(__file__).resolve().parents[3].parent / "shared" / "data"
STORIES = DATA / "stories260K"
TEXTS = sorted((DATA / "tinystories").glob("*.txt"))
FIRST, LAST = (str(TEXTS[0]), str(TEXTS[-1])) if TEXTS else ("absent", "absent")  # the module skips without them

pytestmark = pytest.mark.skipif(not (STORIES / "stories260K.bin").is_file() or len(TEXTS) < 2,
                                reason=f"stories260K / tinystories not found under {DATA}")

BASE = {"--method": ["int8"], "--tasks": ["passkey"], "--lengths": ["160"], "--n": ["2"], "--setting": ["agnostic"],
        "--stories": [FIRST]}


def _argv(**change) -> list[str]:
    """The finished run's options with ``change`` (``n=["3"]`` sets ``--n 3``)."""
    opts = {**BASE, **{"--" + k.replace("_", "-"): v for k, v in change.items()}}
    return [x for k, v in opts.items() for x in (k, *v)] + ["--no-progress"]


@pytest.fixture(scope="module")
def finished(s260k, tmp_path_factory) -> Path:
    """A finished run (2 passkey instances, agnostic, int8 beside the full cache, --stories TEXTS[0])."""
    out = tmp_path_factory.mktemp("r") / "r.json"
    assert eval_tasks.main(["--model", s260k, *_argv(), "--out", str(out)]) == 0
    return out


def _run(argv, capsys):
    return run_tool(eval_tasks.main, argv, capsys)


def _copy(finished: Path, tmp_path: Path) -> Path:
    out = tmp_path / "r.json"
    shutil.copy(finished, out)
    return out


@pytest.mark.parametrize("change, option", [
    (dict(stories=[LAST]), "--stories"),
    (dict(door=["hf"]), "--door"),
    (dict(dtype=["bf16"]), "--dtype"),
    (dict(seed0=["2"]), "--seed0"),
    (dict(n=["1"]), "--n 1"),
    (dict(tasks=["niah_number_filler"], lengths=["250"]), "--tasks"),
    (dict(lengths=["170"]), "--lengths"),
    (dict(setting=["aware"]), "--setting"),
])
def test_resume_refuses_another_run(s260k, finished, tmp_path, capsys, change, option) -> None:
    out = _copy(finished, tmp_path)
    before = out.read_bytes()
    rc, _, err = _run(["--model", s260k, *_argv(**change), "--out", out], capsys)
    line = one_error(rc, err, "eval_tasks", option)
    assert "--force" in line and out.read_bytes() == before


def test_resume_adds_instances_only(s260k, finished, tmp_path, capsys, monkeypatch) -> None:
    """More seeds and the other setting: the finished answers are kept (never recomputed), only the new instances
    run, and the header describes all of them."""
    out = _copy(finished, tmp_path)
    old = json.loads(out.read_text())
    ran: list[tuple[str, str]] = []
    from kvsplice.tasks import shared

    real = shared.answer_many

    def counting(model, tok, inst, todo, *, setting):
        ran.append((setting, inst.key))
        return real(model, tok, inst, todo, setting=setting)

    monkeypatch.setattr(shared, "answer_many", counting)
    rc, _, err = _run(["--model", s260k, *_argv(n=["3"], setting=["both"]), "--out", out], capsys)
    assert rc == 0, err
    doc = json.loads(out.read_text())
    assert ("agnostic", "passkey/160/2") in ran and len(ran) == 1 + 3  # 1 new agnostic, 3 aware
    for key, outs in old["results"]["agnostic"].items():
        assert doc["results"]["agnostic"][key] == outs
    assert doc["n"] == 3 and doc["settings"] == ["agnostic", "aware"] and len(doc["instances"]) == 3
    assert doc["summary"]["aware"]["int8"]["n"] == 3


def test_resume_takes_the_same_tokenizer_from_another_path(s260k, finished, tmp_path, capsys, monkeypatch) -> None:
    """The same model and tokenizer named by another path (a link to the folder) continue the file, new and
    earlier-form fingerprints alike (the earlier one hashed the path): no finished answer is run again."""
    from kvsplice.loading import load_model
    from kvsplice.tasks import shared
    from kvsplice.tasks.provenance import tokenizer_fingerprint

    link = tmp_path / "same_model"
    link.symlink_to(s260k, target_is_directory=True)
    tok = load_model(s260k).tokenizer
    legacy = tokenizer_fingerprint(tok, loaded_from=s260k)
    assert legacy != tokenizer_fingerprint(tok) == tokenizer_fingerprint(load_model(str(link)).tokenizer)
    ran: list[str] = []
    monkeypatch.setattr(shared, "answer_many", lambda *a, **k: ran.append(a[2].key) or {})
    for form in ("new", "earlier"):
        out = _edited(finished, tmp_path, lambda d: d.update(tokenizer_fingerprint=legacy) if form == "earlier"
                      else None)
        rc, _, err = _run(["--model", link, *_argv(), "--out", out], capsys)
        assert rc == 0, err
        assert json.loads(out.read_text())["tokenizer_fingerprint"] == tokenizer_fingerprint(tok)
    assert ran == []


def _edited(finished: Path, tmp_path: Path, edit) -> Path:
    out = _copy(finished, tmp_path)
    doc = json.loads(out.read_text())
    edit(doc)
    out.write_text(json.dumps(doc))
    return out


def _first(doc) -> dict:
    return next(iter(doc["results"]["agnostic"].values()))


EDITS = {
    "results a string": (lambda d: d.update(results="x"), "results must be an object"),
    "results a list": (lambda d: d.update(results=[1]), "results must be an object"),
    "no score": (lambda d: _first(d)["int8"].pop("score"), "has no score"),
    "score a string": (lambda d: _first(d)["int8"].update(score="1"), "score must be a fraction"),
    "score 999": (lambda d: _first(d)["int8"].update(score=999), "score must be a fraction in [0, 1], got 999"),
    "methods a list": (lambda d: d.update(methods=["int8"]), "methods must be an object"),
    "n_compressed 0": (lambda d: _first(d)["full"].update(n_compressed=0), "n_compressed must be an integer >= 1"),
    "bytes negative": (lambda d: _first(d)["full"].update(fp16_bytes=-1), "fp16_bytes must be a finite number"),
    "bad key": (lambda d: d["results"]["agnostic"].update({"passkey": {}}), "is not task/length/seed"),
    "key spelled otherwise": (lambda d: d["results"]["agnostic"].update({"passkey/0160/0": {}}), "do not list"),
    "version 1": (lambda d: d.update(version=1), "version 1"),
    "prompt changed": (lambda d: d["instances"].update({k: "0" * 16 for k in d["instances"]}), "prompt differs"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_resume_refuses_a_hand_edited_file(s260k, finished, tmp_path, capsys, name) -> None:
    edit, words = EDITS[name]
    out = _edited(finished, tmp_path, edit)
    before = out.read_bytes()
    rc, _, err = _run(["--model", s260k, *_argv(), "--out", out], capsys)
    one_error(rc, err, "eval_tasks", words)
    assert out.read_bytes() == before


def test_resume_runs_a_method_again_when_its_file_changes(s260k, tmp_path, capsys) -> None:
    """A ``.json`` spec file rewritten with the same label but other content: its answers are run again."""
    spec = tmp_path / "m.json"
    spec.write_text(json.dumps({"name": "dense", "cache_quant": "int8"}))
    argv = ["--model", s260k, *_argv(method=[str(spec)]), "--out", tmp_path / "r.json"]
    assert _run(argv, capsys)[0] == 0
    spec.write_text(json.dumps({"name": "dense", "cache_quant": "int8"}, indent=4))  # same method, other bytes
    rc, _, err = _run(argv, capsys)
    assert rc == 0 and "its results are run again" in err


def test_tokenizer_fingerprint_tells_tokenizers_apart(s260k) -> None:
    from kvsplice.loading import load_model, load_tokenizer
    from kvsplice.tasks.provenance import tokenizer_fingerprint

    a, b = load_model(s260k).tokenizer, load_model(s260k).tokenizer
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    if (DATA / "gpt2_tokenizer").is_dir():
        assert tokenizer_fingerprint(load_tokenizer(DATA / "gpt2_tokenizer")) != tokenizer_fingerprint(a)


REDERIVED = {
    "forged output": (lambda o: o.update(output=o["output"] + " 12345"), "output is not what its tokens decode to"),
    "forged tokens": (lambda o: o.update(tokens=[1, 2, 3]), "output is not what its tokens decode to"),
    "token id 1e20": (lambda o: o.update(tokens=[10**20]), "tokens are not at most"),
    "token id a float": (lambda o: o.update(tokens=[1.5]), "tokens are not at most"),
    "n_prompt 1e12": (lambda o: o.update(n_prompt=10**12), "n_prompt 1000000000000"),
    "n_prompt off by one": (lambda o: o.update(n_prompt=o["n_prompt"] + 1), "is not the instance's prompt length"),
}


@pytest.mark.parametrize("name", sorted(REDERIVED))
def test_resume_runs_again_an_answer_its_record_does_not_derive(s260k, finished, tmp_path, capsys, monkeypatch,
                                                                 name) -> None:
    """A kept answer is re-derived from its own record: an output its tokens do not decode to (a forged output
    holding the answer would score 1), tokens outside the vocabulary, an ``n_prompt`` that is not the prompt's. Such
    an answer is run again (one note), the others are kept."""
    from kvsplice.tasks import shared

    edit, words = REDERIVED[name]
    old = json.loads(finished.read_text())
    key = next(iter(old["results"]["agnostic"]))
    out = _edited(finished, tmp_path, lambda d: edit(d["results"]["agnostic"][key]["int8"]))
    ran: list = []
    real = shared.answer_many
    monkeypatch.setattr(shared, "answer_many", lambda model, tok, inst, todo, *, setting: ran.append(
        (inst.key, sorted(todo))) or real(model, tok, inst, todo, setting=setting))
    rc, _, err = _run(["--model", s260k, *_argv(), "--out", out], capsys)
    assert rc == 0, err
    assert ran == [(key, ["int8"])], ran
    assert words in err and err.count("note:") == 1, err
    doc = json.loads(out.read_text())
    got, want = doc["results"]["agnostic"][key]["int8"], old["results"]["agnostic"][key]["int8"]
    assert (got["output"], got["tokens"], got["n_prompt"]) == (want["output"], want["tokens"], want["n_prompt"])


def test_resume_drops_an_answer_of_a_method_the_file_does_not_record(s260k, finished, tmp_path, capsys) -> None:
    old = json.loads(finished.read_text())
    key = next(iter(old["results"]["agnostic"]))
    out = _edited(finished, tmp_path, lambda d: d["results"]["agnostic"][key].update(
        nosuch=dict(d["results"]["agnostic"][key]["int8"])))
    rc, _, err = _run(["--model", s260k, *_argv(), "--out", out], capsys)
    assert rc == 0, err
    assert "method 'nosuch' is not one the file records" in err
    assert "nosuch" not in json.loads(out.read_text())["results"]["agnostic"][key]
