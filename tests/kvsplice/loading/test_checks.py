"""Config values checked against the weights before a model is built: hand-edited ``config.json`` values (a NaN or
negative ``rope_theta`` / ``rms_norm_eps``, a million layers, a hidden size the weights do not have) and the same
values in a GGUF header are one ``LoadError`` line from ``load_model``, and ``to-gguf`` refuses such a folder."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from hostile import STORIES260K, one_error, run_tool, s260k  # noqa: F401  (s260k: a fixture)
from kvsplice.loading import LoadError, load_model
from kvsplice.loading.checks import check_gguf_file, check_model_folder, gguf_header

pytestmark = pytest.mark.skipif(not (STORIES260K / "stories260K.bin").is_file(), reason="stories260K not found")


def edited(src: str, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))  # NaN written as NaN, as a hand edit in Python would
    return dst


@pytest.mark.parametrize("changes, expect", [
    (dict(rope_theta=float("nan")), "rope_theta must be a finite number > 0, got nan"),
    (dict(rope_theta=-1), "rope_theta must be a finite number > 0, got -1"),
    (dict(rms_norm_eps=-1), "rms_norm_eps must be a finite number > 0, got -1"),
    (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0"),
    (dict(num_hidden_layers=1000000), "num_hidden_layers is 1000000 but the weights have 5 numbered layers"),
    (dict(num_hidden_layers=6), "num_hidden_layers is 6 but the weights have 5 numbered layers"),
    (dict(hidden_size=1000000000), "hidden_size is 1000000000 but the weights have 64 columns"),
    (dict(num_hidden_layers=10**12), "num_hidden_layers must be an integer in [1, "),
])
def test_hand_edited_config_is_one_line_before_the_model_is_built(s260k, tmp_path, changes, expect):
    folder = edited(s260k, tmp_path / "m", **changes)
    t0 = time.perf_counter()
    with pytest.raises(LoadError) as e:
        load_model(folder)
    assert expect in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert time.perf_counter() - t0 < 30


def test_the_real_folder_and_gguf_pass(s260k):
    check_model_folder(Path(s260k))
    gguf = STORIES260K.parent / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if gguf.is_file():
        meta, shapes = gguf_header(gguf)
        assert meta["llama.block_count"] == 30 and shapes["token_embd.weight"] == (49152, 576)
        check_gguf_file(gguf)


def _gguf(path: Path, blocks: int, hidden: int, theta: float = 10000.0) -> Path:
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    w.add_block_count(blocks)
    w.add_embedding_length(hidden)
    w.add_rope_freq_base(theta)
    w.add_tensor("token_embd.weight", np.zeros((32, 8), dtype=np.float32))  # (vocab, hidden)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("blocks, hidden, theta, expect", [
    (1000000, 8, 1e4, "num_hidden_layers is 1000000 but the weights have 1 numbered layers"),
    (1, 4096, 1e4, "hidden_size is 4096 but the weights have 8 columns"),
    (1, 8, float("nan"), "rope_theta must be a finite number > 0"),
])
def test_a_gguf_whose_metadata_does_not_match_its_tensors_is_refused(tmp_path, blocks, hidden, theta, expect):
    path = _gguf(tmp_path / "m.gguf", blocks, hidden, theta)
    with pytest.raises(LoadError, match="m.gguf: ") as e:
        load_model(path)
    assert expect in str(e.value)


def test_to_gguf_refuses_a_folder_whose_config_does_not_match_its_weights(s260k, tmp_path, capsys):
    from kvsplice.cli import to_gguf

    folder = edited(s260k, tmp_path / "m", hidden_size=1000000000)
    rc, _, err = run_tool(to_gguf.main, [folder, "--out", tmp_path / "m.gguf"], capsys)
    one_error(rc, err, "to-gguf", "hidden_size is 1000000000 but the weights have 64 columns")
    assert not (tmp_path / "m.gguf").exists()


@pytest.mark.parametrize("changes, expect", [
    (dict(n_layer=1000000), "n_layer is 1000000 but the weights have 2 numbered layers"),
    (dict(d_model=1000000000), "d_model is 1000000000 but the weights have 64 columns"),
    (dict(norm_eps=-1.0), "norm_eps must be a finite number > 0, got -1.0"),
    (dict(rope_theta=float("nan")), "rope_theta must be a finite number > 0, got nan"),
])
def test_a_native_mla_folder_is_checked_the_same_way(tmp_path, changes, expect):
    from kvsplice.loading.mla_folder import save_mla_folder
    from tiny_models import converted_tiny_llama

    _, mla = converted_tiny_llama(tmp_path / "ds")
    save_mla_folder(mla, tmp_path / "native")
    check_model_folder(tmp_path / "native")
    folder = edited(str(tmp_path / "native"), tmp_path / "m", **changes)
    with pytest.raises(LoadError) as e:
        load_model(folder)
    assert expect in str(e.value), str(e.value)


def test_layer_counts_that_real_checkpoints_have_pass():
    """DeepSeek-V3's multi-token-prediction layers follow its ``num_hidden_layers``; a multimodal model's vision tower
    has layers of its own: neither is a mismatch."""
    from kvsplice.loading.checks import _check_against

    shapes = {f"model.layers.{i}.mlp.weight": (4, 4) for i in range(62)} | {"model.embed_tokens.weight": (100, 16)}
    _check_against({"num_hidden_layers": 61, "num_nextn_predict_layers": 1, "hidden_size": 16}, shapes, "c")
    with pytest.raises(ValueError, match="num_hidden_layers is 60 but the weights have 62"):
        _check_against({"num_hidden_layers": 60, "num_nextn_predict_layers": 1}, shapes, "c")
    mm = {f"vision_tower.encoder.layers.{i}.w": (2, 2) for i in range(27)}
    mm |= {f"model.language_model.layers.{i}.w": (2, 2) for i in range(3)}
    _check_against({"text_config": {"num_hidden_layers": 3}, "vision_config": {"num_hidden_layers": 27}}, mm, "c")
