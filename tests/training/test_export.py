"""``kvsplice export``: MHA → GPT2LMHeadModel, MLA / KVSplice / grouped-query → a trust_remote_code
directory; logits within 1e-5 (fp32) of models.GPT, generate() == GPT.generate, cache bytes == the package's
formula, left padding, the run's tokenizer, one-line errors.

Hostile inputs: nothing a user owns is deleted — not the run folder
of ``--ckpt`` (``--out RUNDIR --force``), not the parent of ``--out some/dir/..``, not ``.``; a read-only
destination is one line; checkpoints with NaN / integer / misshapen weights are refused naming the tensor; an MHA
export of a small vocabulary writes its own end-of-text id, not GPT-2's 50256; ``--force`` replaces exactly an
earlier export's files; a killed export's temporary folder is removed by the next one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import transformers

from models import GPT
from models.config import GPTConfig
from kvsplice.report.memory import cache_bytes_formula
from models.checkpoint import save_model
from hostile import dead_pid, edit_ckpt, one_error, readonly_dir, snapshot, tiny_ckpt  # noqa: F401
from tiny_models import sharpen
from training import export as ex

V = 97
BASE = dict(vocab_size=V, n_layer=2, n_head=4, d_model=32, block_size=64, d_latent=16)
VARIANTS = {
    "mla": dict(attention="mla"),
    "kvsplice": dict(attention="mla", kvsplice_keep=0.25),
    "kvsplice-orthogonal-nobias": dict(attention="mla", kvsplice_keep=0.5, kvsplice_orthogonal=True, bias=False),
    "kvsplice-latent-norm": dict(attention="mla", kvsplice_keep=0.25, latent_norm=True),
    "gqa": dict(attention="mha", n_kv_head=2),
    "mqa": dict(attention="mha", n_kv_head=1),
}


def make_ckpt(tmp_path, data_hparams=None, seed=0, **kw):
    torch.manual_seed(seed)
    cfg = GPTConfig(**{**BASE, **kw})
    model = sharpen(GPT(cfg), std=0.2, seed=seed)
    path = save_model(model, tmp_path / f"model-{seed}.ckpt", data_hparams=data_hparams)
    return path, model, cfg


def ids(b=2, t=11, seed=1):
    return torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))


def load_remote(out):
    return transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()


# ------------------------------------------------------------------------------------------------- MHA
@pytest.mark.parametrize("bias", [True, False])
def test_mha_exports_a_plain_gpt2_with_equal_logits(tmp_path, bias):
    ckpt, model, cfg = make_ckpt(tmp_path, bias=bias)
    summary = ex.export(ckpt, tmp_path / "out", tokenizer=False)
    assert summary["kind"] == "GPT2LMHeadModel"
    hf = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "out").eval()
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), atol=1e-5, rtol=0)
        out = hf.generate(x[:1], max_new_tokens=10, do_sample=False, pad_token_id=0)
    assert torch.equal(out, model.generate(x[:1], 10, temperature=0.0))
    assert (tmp_path / "out" / "model.safetensors").is_file()


# ---------------------------------------------------------------------------------- MLA / KVSplice / GQA
@pytest.mark.parametrize("variant", VARIANTS)
def test_remote_code_export_logits_generate_and_cache_bytes(tmp_path, variant):
    ckpt, model, cfg = make_ckpt(tmp_path, **VARIANTS[variant])
    summary = ex.export(ckpt, tmp_path / "out", tokenizer=False)
    assert summary["kind"] == "remote-code"
    assert {"configuration_kvsplice_gpt.py", "modeling_kvsplice_gpt.py", "config.json"} <= set(summary["files"])
    hf = load_remote(tmp_path / "out")
    assert type(hf).__name__ == "KVSpliceGPTForCausalLM"
    x = ids()
    with torch.no_grad():
        ref = model(x)
        torch.testing.assert_close(hf(x, use_cache=False).logits, ref, atol=1e-5, rtol=0)  # full forward
        cache = hf.new_cache()  # cached: prefill 7 tokens absorbed, then one token at a time
        got = [hf(x[:, :7], past_key_values=cache).logits]
        got += [hf(x[:, i:i + 1], past_key_values=cache).logits for i in range(7, x.shape[1])]
        torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-5, rtol=0)
        n = 12
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0,
                          return_dict_in_generate=True)
    assert torch.equal(out.sequences, model.generate(x, n, temperature=0.0))
    t = x.shape[1] + n - 1  # tokens cached: the prompt + the generated tokens fed back
    c = out.past_key_values
    want = cache_bytes_formula(cfg, t, "fp32", batch_size=x.shape[0])
    assert c.nbytes() == want == x.shape[0] * t * cfg.n_layer * cfg.cache_dim * 4
    if cfg.attention == "mla":
        assert all(s.shape == (x.shape[0], t, cfg.cache_dim) for s in c.tensors())  # only the (compressed) latent


def test_remote_left_padding_equals_one_at_a_time(tmp_path):
    ckpt, model, cfg = make_ckpt(tmp_path, **VARIANTS["kvsplice"])
    ex.export(ckpt, tmp_path / "out", tokenizer=False)
    hf = load_remote(tmp_path / "out")
    seqs = [ids(1, t, seed=t)[0] for t in (9, 4, 6)]
    T = max(len(s) for s in seqs)
    x = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros_like(x)
    for i, s in enumerate(seqs):
        x[i, T - len(s):], mask[i, T - len(s):] = s, 1
    with torch.no_grad():
        batched = hf.generate(x, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        for i, s in enumerate(seqs):
            alone = hf.generate(s[None], attention_mask=torch.ones_like(s[None]), max_new_tokens=8,
                                do_sample=False, pad_token_id=0)
            assert torch.equal(batched[i, T:], alone[0, len(s):]), i
            assert torch.equal(alone, model.generate(s[None], 8, temperature=0.0))


# ---------------------------------------------------------------------------------- tokenizer and errors
def test_the_runs_tokenizer_is_exported(tmp_path):
    from data import TinyStoriesDataModule

    hp = dict(synthetic=True, synthetic_stories=300, synthetic_vocab_size=300, cache_dir=str(tmp_path / "cache"))
    tok = TinyStoriesDataModule(**hp).tokenizer
    ckpt, model, cfg = make_ckpt(tmp_path, data_hparams=hp, attention="mla", vocab_size=tok.vocab_size)
    ex.export(ckpt, tmp_path / "out")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "Once upon a time there was a dog."
    assert hf_tok(text, add_special_tokens=False).input_ids == tok.encode(text)
    assert hf_tok.eos_token_id == tok.eot_id
    assert transformers.GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == tok.eot_id


def test_bad_inputs_are_one_line_and_write_nothing(tmp_path, capsys):
    ckpt, _, _ = make_ckpt(tmp_path, attention="mla")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("keep")
    junk = tmp_path / "junk.ckpt"
    junk.write_bytes(b"not a checkpoint")
    cases = {"non-empty out": ["--ckpt", ckpt, "--out", busy], "missing ckpt": ["--ckpt", tmp_path / "no.ckpt",
             "--out", tmp_path / "o1"], "corrupt ckpt": ["--ckpt", junk, "--out", tmp_path / "o2"],
             "missing option": ["--ckpt", ckpt], "out is a file": ["--ckpt", ckpt, "--out", junk]}
    for name, argv in cases.items():
        rc = ex.main([str(a) for a in argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("kvsplice export: error: "), (name, err)
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    # --force replaces an earlier export only, never a folder holding other files
    assert ex.main(["--ckpt", str(ckpt), "--out", str(busy), "--force", "--no-tokenizer"]) == 2
    assert "holds files export does not write (keep.txt)" in capsys.readouterr().err
    assert [p.name for p in busy.iterdir()] == ["keep.txt"]


# ------------------------------------------------------------------------------------------------- hostile inputs
W = "model.transformer.h.0.attn.c_attn.weight"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, data_cache) -> Path:
    """A run folder as training.fit leaves it: checkpoints, config, metrics."""
    d = tmp_path_factory.mktemp("runs") / "tiny_gpt2"
    d.mkdir()
    tiny_ckpt(d / "last.ckpt", data_cache)
    (d / "config.yaml").write_text("model: {}\n")
    (d / "metrics.csv").write_text("step,train_loss\n0,5.0\n")
    return d


def export(argv, capsys):
    capsys.readouterr()
    rc = ex.main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def test_force_never_deletes_the_run_folder_or_a_parent(run_dir, tmp_path, capsys, monkeypatch):
    ckpt = run_dir / "last.ckpt"
    before = snapshot(run_dir.parent)
    cases = {  # --out, text of the refusal
        "the run folder (item 1)": (run_dir, "contains the input --ckpt"),
        "its parent through .. (item 2)": (run_dir / "sub" / "..", "contains the input --ckpt"),
        "a symlink to the run folder": (tmp_path / "link", "contains the input --ckpt"),
        "the checkpoint file": (ckpt, "exists and is not a directory"),
    }
    (tmp_path / "link").symlink_to(run_dir)
    for name, (out, expect) in cases.items():
        rc, err = export(["--ckpt", ckpt, "--out", out, "--force"], capsys)
        one_error(rc, err, ex.PROG, expect)
        assert snapshot(run_dir.parent) == before, name
    # some/dir/.. with the checkpoint elsewhere: `some` holds other files, so it is refused, not emptied
    some = tmp_path / "some"
    (some / "dir").mkdir(parents=True)
    (some / "notes.txt").write_text("mine")
    rc, err = export(["--ckpt", ckpt, "--out", some / "dir" / "..", "--force"], capsys)
    one_error(rc, err, ex.PROG, "holds files export does not write (dir, notes.txt)")
    assert sorted(p.name for p in some.iterdir()) == ["dir", "notes.txt"]
    # --out . (item 9: was "PosixPath('.') has an empty name"): a non-empty cwd is refused in one line ...
    monkeypatch.chdir(some)
    rc, err = export(["--ckpt", ckpt, "--out", ".", "--force"], capsys)
    one_error(rc, err, ex.PROG, "holds files export does not write")
    # ... and an empty cwd receives the export (the folder itself is kept: the shell may be in it)
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.chdir(empty)
    rc, err = export(["--ckpt", ckpt, "--out", ".", "--no-tokenizer"], capsys)
    assert rc == 0, err
    assert (empty / "model.safetensors").is_file() and Path.cwd() == empty


def test_read_only_or_impossible_destination_is_one_line(run_dir, tmp_path, readonly_dir, capsys):
    ckpt = run_dir / "last.ckpt"
    rc, err = export(["--ckpt", ckpt, "--out", readonly_dir / "hf"], capsys)
    one_error(rc, err, ex.PROG, "cannot write in")
    rc, err = export(["--ckpt", ckpt, "--out", run_dir / "metrics.csv" / "hf"], capsys)
    one_error(rc, err, ex.PROG, "is a file, not a folder")
    rc, err = export(["--ckpt", ckpt, "--out", ""], capsys)
    one_error(rc, err, ex.PROG, "--out is empty")


@pytest.mark.parametrize("name, value, expect", [
    ("nan", torch.full((96, 32), float("nan")), f"tensor {W} holds 3072 NaN/inf values"),
    ("inf", torch.eye(96, 32) / 0.0, f"tensor {W} holds"),
    ("int32", torch.ones(96, 32, dtype=torch.int32), f"tensor {W} has dtype int32"),
    ("shape", torch.zeros(96, 31), f"tensor {W} has shape (96, 31), expected (96, 32)"),
    ("not a tensor", [1.0, 2.0], f"tensor {W} is a list"),
])
def test_checkpoint_tensors_are_checked(run_dir, tmp_path, capsys, name, value, expect):
    bad = edit_ckpt(run_dir / "last.ckpt", tmp_path / f"{name}.ckpt", W, value)
    rc, err = export(["--ckpt", bad, "--out", tmp_path / "out"], capsys)
    assert str(bad) in one_error(rc, err, ex.PROG, expect)
    assert not (tmp_path / "out").exists()


def test_small_vocabulary_mha_export_has_its_own_bos_eos(run_dir, tmp_path, capsys):
    """Item 7: config.json said bos/eos 50256 for a 300-token vocabulary."""
    rc, err = export(["--ckpt", run_dir / "last.ckpt", "--out", tmp_path / "hf"], capsys)
    assert rc == 0, err
    cfg = json.loads((tmp_path / "hf" / "config.json").read_text())
    gen = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert cfg["vocab_size"] == 300 and cfg["bos_token_id"] == cfg["eos_token_id"] == gen["eos_token_id"] == 0
    rc, err = export(["--ckpt", run_dir / "last.ckpt", "--out", tmp_path / "bare", "--no-tokenizer"], capsys)
    cfg = json.loads((tmp_path / "bare" / "config.json").read_text())
    assert rc == 0 and cfg.get("bos_token_id") is None and cfg.get("eos_token_id") is None


def test_force_replaces_exactly_an_earlier_export(run_dir, tmp_path, data_cache, capsys):
    out = tmp_path / "hf"
    mla = tiny_ckpt(tmp_path / "mla.ckpt", data_cache, attention="mla")
    stale = tmp_path / f".hf.{dead_pid()}.tmp"  # a killed export's temporary folder
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    rc, err = export(["--ckpt", mla, "--out", out, "--no-tokenizer"], capsys)
    assert rc == 0, err
    assert not stale.exists()
    remote = {p.name for p in out.iterdir()}
    assert "modeling_kvsplice_gpt.py" in remote and remote <= ex.EXPORT_FILES
    rc, err = export(["--ckpt", run_dir / "last.ckpt", "--out", out], capsys)
    one_error(rc, err, ex.PROG, "is not empty (use --force")
    rc, err = export(["--ckpt", run_dir / "last.ckpt", "--out", out, "--force"], capsys)
    assert rc == 0, err
    names = {p.name for p in out.iterdir()}  # the GPT-2 export, without the remote code of the earlier one
    assert "modeling_kvsplice_gpt.py" not in names and {"model.safetensors", "tokenizer.json"} <= names
    assert names <= ex.EXPORT_FILES and not [p for p in os.listdir(tmp_path) if p.startswith(".hf.")]
    assert json.loads((out / "config.json").read_text())["model_type"] == "gpt2"
    # a folder named like an export file is never removed to make room: not in a folder without export's marker ...
    trap = tmp_path / "trap"
    (trap / "model.safetensors").mkdir(parents=True)
    (trap / "model.safetensors" / "mine.txt").write_text("mine")
    rc, err = export(["--ckpt", mla, "--out", trap, "--force", "--no-tokenizer"], capsys)
    one_error(rc, err, ex.PROG, "holds files export does not write (model.safetensors): no .kvsplice-output.json")
    assert (trap / "model.safetensors" / "mine.txt").read_text() == "mine" and os.listdir(trap) == ["model.safetensors"]
    # ... nor in an earlier export whose weights file a user replaced by a folder
    rc, err = export(["--ckpt", mla, "--out", tmp_path / "trap2", "--no-tokenizer"], capsys)
    assert rc == 0, err
    trap2 = tmp_path / "trap2"
    (trap2 / "model.safetensors").unlink()
    (trap2 / "model.safetensors").mkdir()
    (trap2 / "model.safetensors" / "mine.txt").write_text("mine")
    before = snapshot(trap2)
    rc, err = export(["--ckpt", mla, "--out", trap2, "--force", "--no-tokenizer"], capsys)
    one_error(rc, err, ex.PROG, "changed since export wrote them (model.safetensors")
    assert snapshot(trap2) == before


def test_export_as_a_library_call_leaves_only_its_output(tmp_path):
    """``export()`` called from Python (not through the CLI, whose end releases every claim) leaves no ``.out.claim``
    lock file beside its folder: the folder holding it is the same before and after but for the export."""
    ckpt, _, _ = make_ckpt(tmp_path, attention="mla")
    before = sorted(p.name for p in tmp_path.iterdir())
    ex.export(ckpt, tmp_path / "out", tokenizer=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*before, "out"])


def test_export_options_are_declared_once():
    """``kvsplice export``'s parser is :class:`training.export.ExportOptions` (every field an option with its help;
    the required options alone give the dataclass's defaults)."""
    from declared_options import check_declared
    from training.export import ExportOptions, build_parser

    o = check_declared(build_parser(), ExportOptions, ["--ckpt", "c", "--out", "o"], ckpt="c", out="o")
    assert (o.tokenizer, o.format, o.force) == (True, "auto", False)
