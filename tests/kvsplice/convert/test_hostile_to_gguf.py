"""Hostile input to ``kvsplice to-gguf`` and the llama.cpp engine (:class:`LlamaCppModel`): a user's file named like
a temporary, a full disk, damaged GGUFs, bad numbers, a hand-converted DeepSeek-V3 GGUF, Ctrl-C after the fix is
written. Every case is one line (exit 2 / a one-line exception) or one ``interrupted`` line (exit 130), and nothing a
user owns is lost or left half-written. The engine's cases that load a model need llama.cpp (marker ``engines``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from hostile import interrupt_at_exit, one_error, one_interrupt, small_disk, snapshot
from kvsplice.cli import to_gguf
from kvsplice.convert.engines import gguf_convert, llama_cpp
from kvsplice.convert.engines.kv_types import kv_type

PROG = to_gguf.PROG
SMOL = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "smollm2-135m-instruct" / \
    "SmolLM2-135M-Instruct.Q4_1.gguf"


def deepseek2_gguf(path: Path, *, tensor_bytes: int = 48, complete: bool = True) -> Path:
    """A ``deepseek2`` GGUF without ``q_lora_rank`` (as llama.cpp's converter writes it), with one f32 tensor of
    ``tensor_bytes``; ``complete``: with the hyper-parameters llama.cpp reads before ``q_lora_rank``."""
    gguf = gguf_convert.gguf_module()
    w = gguf.GGUFWriter(str(path), arch="deepseek2")
    w.add_block_count(2)
    w.add_kv_lora_rank(16)
    if complete:
        w.add_context_length(64)
        w.add_embedding_length(32)
        w.add_feed_forward_length(64)
        w.add_head_count(2)
        w.add_layer_norm_rms_eps(1e-6)
    w.add_token_list(["a", "b"])
    w.add_tensor("blk.0.attn_kv_a_mqa.weight", np.arange(tensor_bytes // 4, dtype=np.float32).reshape(-1, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def fix(path, capsys):
    capsys.readouterr()
    rc = to_gguf.main(["--fix", str(path)])
    return rc, capsys.readouterr()


# -------------------------------------------------------------------------------------------- temporary names
def test_fix_never_touches_a_users_file_named_like_a_temporary(tmp_path, capsys):
    g = deepseek2_gguf(tmp_path / "X.gguf")
    for name in ("X.gguf.tmp", ".X.gguf.tmp", f".X.gguf.{1}.tmp"):
        (tmp_path / name).write_text(f"the user's {name}")
    rc, (out, err) = fix(g, capsys)
    assert rc == 0 and "added deepseek2.attention.q_lora_rank" in out, err
    for name in ("X.gguf.tmp", ".X.gguf.tmp", f".X.gguf.{1}.tmp"):
        assert (tmp_path / name).read_text() == f"the user's {name}"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["X.gguf", "X.gguf.tmp", ".X.gguf.tmp",
                                                                 ".X.gguf.1.tmp"])


def test_fix_on_a_full_disk_is_one_line_and_leaves_the_gguf_as_it_was(tmp_path, capsys):
    with small_disk(tmp_path / "disk") as disk:
        g = deepseek2_gguf(disk / "X.gguf", tensor_bytes=40 * 1024)  # a copy does not fit beside it
        before = snapshot(disk)
        rc, (_, err) = fix(g, capsys)
        one_error(rc, err, PROG, f"cannot write {g}")
        assert snapshot(disk) == before  # the GGUF unchanged, no half-written temporary beside it


# ------------------------------------------------------------------------------------------------ damaged files
@pytest.mark.parametrize("kind", ["random", "truncated", "empty", "directory", "missing", "not-deepseek2"])
def test_fix_of_a_damaged_or_wrong_file_is_one_line_or_untouched(tmp_path, capsys, kind):
    p = tmp_path / "X.gguf"
    if kind == "random":
        p.write_bytes(np.random.default_rng(0).bytes(4096))
    elif kind == "truncated":
        g = deepseek2_gguf(tmp_path / "whole.gguf")
        p.write_bytes(g.read_bytes()[:100])
    elif kind == "empty":
        p.write_bytes(b"")
    elif kind == "directory":
        p.mkdir()
    elif kind == "not-deepseek2":
        gguf = gguf_convert.gguf_module()
        w = gguf.GGUFWriter(str(p), arch="llama")
        w.add_block_count(1)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    before = snapshot(tmp_path)
    rc, (out, err) = fix(p, capsys)
    if kind == "not-deepseek2":
        assert rc == 0 and "nothing to add" in out
    else:
        one_error(rc, err, PROG)
    assert snapshot(tmp_path) == before


def test_to_gguf_without_a_folder_or_a_bad_outtype_is_one_line(tmp_path, capsys):
    for argv in ([], ["--out", str(tmp_path / "x.gguf")], [str(tmp_path), "--out", str(tmp_path / "x.gguf")],
                 [str(tmp_path), "--out", str(tmp_path / "x.gguf"), "--outtype", "q2_k"]):
        capsys.readouterr()
        one_error(to_gguf.main(argv), capsys.readouterr().err, PROG)
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------------------------ Ctrl-C
def test_ctrl_c_after_the_fix_is_written_is_one_line_and_keeps_it(tmp_path):
    g = deepseek2_gguf(tmp_path / "X.gguf")
    r = interrupt_at_exit("kvsplice.cli.to_gguf", ["--fix", g])
    one_interrupt(r, PROG)
    gguf = gguf_convert.gguf_module()
    assert gguf.GGUFReader(str(g)).get_field(llama_cpp.Q_LORA_KEY).contents() == 0
    assert [p.name for p in tmp_path.iterdir()] == ["X.gguf"]


def test_ctrl_c_while_fixing_leaves_the_gguf_as_it_was(tmp_path, capsys, monkeypatch):
    g = deepseek2_gguf(tmp_path / "X.gguf")
    before = snapshot(tmp_path)
    gguf = gguf_convert.gguf_module()

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensor_data", interrupted)
    rc, (_, err) = fix(g, capsys)
    assert rc == 130 and err.strip().splitlines() == [f"{PROG}: interrupted"]
    assert snapshot(tmp_path) == before


# ---------------------------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("kw,expect", [
    (dict(n_ctx=0), "n_ctx must be a whole number >= 1"), (dict(n_ctx=-5), "n_ctx must be a whole number >= 1"),
    (dict(n_ctx=2.5), "n_ctx must be a whole number"), (dict(n_batch=0), "n_batch must be"),
    (dict(threads=0), "threads must be"), (dict(type_v="q4_0", flash_attn=False), "only with flash attention"),
    (dict(cache_type="q3_x"), "q3_x"),
])
def test_engine_bad_numbers_are_one_line_before_loading(tmp_path, kw, expect):
    with pytest.raises(ValueError, match=expect) as e:
        llama_cpp.LlamaCppModel(tmp_path / "none.gguf", **kw)
    assert "\n" not in str(e.value)


def _need_llama_cpp():
    why = llama_cpp.missing(converter=False, bindings=True)
    if why:
        pytest.skip(why)


@pytest.mark.engines
def test_engine_refuses_a_context_beyond_the_trained_one_up_front():
    _need_llama_cpp()
    if not SMOL.is_file():
        pytest.skip(f"{SMOL} not found")
    with pytest.raises(ValueError, match="n_ctx 1000000000 needs a KV cache of up to .* trained for 8192") as e:
        llama_cpp.LlamaCppModel(SMOL, n_ctx=10 ** 9)
    assert "\n" not in str(e.value)
    with llama_cpp.LlamaCppModel(SMOL, n_ctx=256) as m:  # within memory: the cache the bound prices from above
        kv = m.kv_cache()
        assert 0 < (kv["k_mib"] + kv["v_mib"]) * 2 ** 20 <= 256 * llama_cpp.cache_bytes_per_cell(
            30, 576, kv_type("f16"), kv_type("f16"))


@pytest.mark.engines
def test_engine_quantised_v_with_flash_attention_on_auto_runs():
    _need_llama_cpp()
    if not SMOL.is_file():
        pytest.skip(f"{SMOL} not found")
    with llama_cpp.LlamaCppModel(SMOL, type_v="q4_0", n_ctx=64) as m:
        assert m.kv_cache()["v_type"] == "q4_0"
        assert len(m.greedy(m.tokenize("Once upon a time"), 2)) == 2


@pytest.mark.engines
def test_engine_names_the_fix_for_a_hand_converted_deepseek_gguf(tmp_path):
    _need_llama_cpp()
    g = deepseek2_gguf(tmp_path / "X.gguf")
    with pytest.raises(RuntimeError) as e:
        llama_cpp.LlamaCppModel(g)
    msg = str(e.value)
    assert "\n" not in msg and f"run kvsplice to-gguf --fix {g}" in msg and llama_cpp.Q_LORA_KEY in msg
    other = deepseek2_gguf(tmp_path / "Y.gguf", complete=False)  # another load failure: its cause, one line
    with pytest.raises(RuntimeError) as e:
        llama_cpp.LlamaCppModel(other)
    assert "\n" not in str(e.value) and "key not found in model" in str(e.value)
