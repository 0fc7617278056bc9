"""llama.cpp's converter on a DeepSeek-V3 folder (:func:`hf_to_gguf`) and the one GGUF key it leaves out
(:func:`fix_gguf`).

**Why a post-conversion step** (:func:`fix_gguf`): llama.cpp's ``deepseek2`` loader reads "no q-LoRA" from the
key ``deepseek2.attention.q_lora_rank = 0`` and requires the key unless the model has 26 or 27 layers (DeepSeek-V2-
Lite's shapes), but its converter writes the key only when ``q_lora_rank`` is set, and the DeepSeek-V3 config that
transformers and vLLM read must say ``q_lora_rank: null`` (a 0 there makes them build a zero-rank ``q_a_proj``).
No config.json satisfies all three, so :func:`hf_to_gguf` runs the converter unchanged and then adds that one key
with gguf-py (a copy of the file with the key added, tensors byte-identical).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvsplice.convert.engines.llama_cpp import Q_LORA_KEY, llama_cpp_root, missing

__all__ = ["fix_gguf", "gguf_module", "hf_to_gguf"]


def gguf_module():
    """gguf-py as vendored with llama.cpp (the converter's own), else the installed ``gguf`` package."""
    vend = llama_cpp_root() / "gguf-py"
    if (vend / "gguf" / "__init__.py").is_file() and str(vend) not in sys.path:
        sys.path.insert(0, str(vend))
        for k in [k for k in sys.modules if k == "gguf" or k.startswith("gguf.")]:
            del sys.modules[k]  # an installed gguf imported earlier: use the converter's
    import gguf

    return gguf


def fix_gguf(path: str | os.PathLike) -> list[str]:
    """Add what llama.cpp's loader needs and its converter leaves out of a ``deepseek2`` GGUF of a model without
    q-LoRA: ``deepseek2.attention.q_lora_rank = 0``. Rewrites ``path`` (atomically: a copy under a fresh temporary
    name beside it, which no file of the user's can have, renamed over it) only when a key is missing; returns the
    keys added (``[]`` for any other file)."""
    gguf = gguf_module()
    path = Path(path)
    reader = gguf.GGUFReader(str(path))
    arch_field = reader.get_field(gguf.Keys.General.ARCHITECTURE)
    arch = arch_field.contents() if arch_field is not None else None
    if arch != "deepseek2" or reader.get_field(Q_LORA_KEY) is not None:
        return []
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # no user file's name
    os.close(fd)
    tmp = Path(name)
    try:
        writer = gguf.GGUFWriter(str(tmp), arch=arch, endianess=reader.endianess)
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            vtype = field.types[0]
            sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
        writer.add_key_value(Q_LORA_KEY, 0, gguf.GGUFValueType.UINT32)
        for t in reader.tensors:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        writer.close()
        del reader
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, path.stat().st_mode & 0o7777)  # the GGUF's own mode, not mkstemp's 0600
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk or Ctrl-C leaves the GGUF as it was and nothing beside it
        raise
    return [Q_LORA_KEY]


def hf_to_gguf(folder: str | os.PathLike, out: str | os.PathLike, outtype: str = "f32",
               quiet: bool = True) -> list[str]:
    """Run llama.cpp's own ``convert_hf_to_gguf.py`` on a model folder (unchanged; a trained GPT-2-style BPE
    tokenizer's pre-tokenizer named for it: :mod:`kvsplice.convert.engines.convert_runner`), then :func:`fix_gguf`.
    Returns the keys the post-step added. Raises ``RuntimeError`` with the converter's last lines if it fails."""
    root = llama_cpp_root()
    why = missing(library=False)
    if why:
        raise RuntimeError(why)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    # the converter, unchanged, through a runner that names GPT-2's pre-tokenizer for a trained GPT-2-style BPE
    # (kvsplice.convert.engines.convert_runner: the tiny configs' tokenizers, which its hash table cannot know)
    cmd = [sys.executable, str(Path(__file__).with_name("convert_runner.py")), str(root), str(folder),
           "--outfile", str(out), "--outtype", outtype]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0 or not Path(out).is_file():
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-5:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed (exit {r.returncode}):\n{tail}")
    if not quiet:
        sys.stderr.write(r.stderr)
    return fix_gguf(out)
