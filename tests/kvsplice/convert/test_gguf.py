"""GGUF models (:mod:`kvsplice.loading.gguf`) from files cut out of the real SmolLM2-135M-Instruct GGUF: a one-layer file
holding every tensor of its model loads and generates; a file that lacks some of them is refused in one line
(it loaded with random layers — transformers' missing-weights warning was hidden — and generated text);
no progress bar reaches stderr (a GGUF error was 2 lines); a folder holding two GGUF files says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hostile import one_error
from kvsplice.cli import generate

gguf = pytest.importorskip("gguf")
SRC = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "smollm2-135m-instruct" / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = pytest.mark.skipif(not SRC.is_file(), reason=f"{SRC} not found")


def gguf_subset(dst: Path, keep, overrides: dict, *, tokenizer: bool = True) -> Path:
    """A GGUF file with ``SRC``'s metadata (``overrides`` changed; without its tokenizer unless ``tokenizer``) and
    the tensors whose names ``keep`` accepts."""
    r = gguf.GGUFReader(str(SRC))
    w = gguf.GGUFWriter(str(dst), arch=r.fields["general.architecture"].contents())
    for name, f in r.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture" and (
                tokenizer or not name.startswith("tokenizer.")):
            w.add_key_value(name, overrides.get(name, f.contents()), f.types[0],
                            sub_type=f.types[1] if len(f.types) > 1 else None)
    tensors = [t for t in r.tensors if keep(t.name)]
    for t in tensors:
        w.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for t in tensors:
        w.write_tensor_data(t.data)
    w.close()
    return dst


ONE_LAYER = {"llama.block_count": 1}


@pytest.fixture(scope="module")
def cut(tmp_path_factory) -> Path:
    """A one-layer file holding 2 of its model's tensors (two norms: small and quick to write)."""
    return gguf_subset(tmp_path_factory.mktemp("gguf") / "two.gguf",
                       lambda n: n in ("blk.0.attn_norm.weight", "output_norm.weight"), ONE_LAYER, tokenizer=False)


def gen(model: Path, tmp_path: Path, capsys):
    capsys.readouterr()
    rc = generate.main(["--model", str(model), "--prompt", "Once upon a time", "--max-new-tokens", "3", "--json",
                        str(tmp_path / "g.json")])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.slow  # ~30 s: GGUF's tokenizer is rebuilt from 49k merges
def test_a_whole_file_loads_and_generates_without_a_progress_bar(tmp_path, capsys):
    whole = gguf_subset(tmp_path / "one.gguf", lambda n: not n.startswith("blk.") or n.startswith("blk.0."), ONE_LAYER)
    rc, _, err = gen(whole, tmp_path, capsys)
    assert rc == 0 and "quantizing" not in err and "it/s" not in err and "warn" not in err.lower(), err
    g = json.loads((tmp_path / "g.json").read_text())
    assert len(g["tokens"]) == 3 and g["cache_bytes"] == g["cache_bytes_formula"]


def test_a_file_lacking_weights_is_refused_in_one_line(cut, tmp_path, capsys):
    rc, _, err = gen(cut, tmp_path, capsys)
    line = one_error(rc, err, "generate", "lacks weights of the model (lm_head.weight, model.embed_tokens.weight")
    assert "(10 in all)" in line and not (tmp_path / "g.json").exists()


def test_a_folder_of_two_gguf_files_says_so(cut, tmp_path, capsys):
    d = tmp_path / "models"
    d.mkdir()
    for name in ("base.gguf", "instruct.gguf"):
        shutil.copy(cut, d / name)
    rc, _, err = gen(d, tmp_path, capsys)
    one_error(rc, err, "generate", f"holds 2 GGUF files (base.gguf, instruct.gguf): pass the one to load, e.g. "
                                   f"--model {d / 'base.gguf'}")


@pytest.mark.slow  # ~60 s: GGUF's tokenizer is rebuilt from 49k merges, twice
def test_load_tokenizer_reads_a_gguf_file_or_its_folder():
    """``load_tokenizer`` of a GGUF (the file or the folder holding only it) is transformers' tokenizer of that file,
    without loading the weights."""
    from transformers import AutoTokenizer

    from kvsplice.loading import load_tokenizer

    text = "Once upon a time, Lily found a shiny red ball."
    ref = AutoTokenizer.from_pretrained(str(SRC.parent), gguf_file=SRC.name)(text, add_special_tokens=False)["input_ids"]
    ours = load_tokenizer(SRC)
    assert ours.encode(text) == ref and ours.eos_id == ref_eos(SRC)
    assert load_tokenizer(SRC.parent).encode(text) == ref


def ref_eos(path: Path) -> int:
    """The end-of-text id the GGUF's metadata names."""
    return int(gguf.GGUFReader(str(path)).fields["tokenizer.ggml.eos_token_id"].contents())
