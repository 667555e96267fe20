"""A converted copy of a GGUF model (dequantized safetensors + config + tokenizer) under $LLMDEPLOY_CACHE_DIR, so
only the first start of a GGUF model pays for transformers' GGUF reader.

The key is the file's resolved path, size and mtime: replacing the file makes a new entry. An entry is built in a
temporary folder and renamed into place, so a concurrent start sees either no entry or a complete one.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import uuid
from pathlib import Path

from llmdeploy.engine.errors import EngineError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the layout of an entry changes
COMPLETE = "llmdeploy-complete"


class GGUFConversionError(EngineError, ValueError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("LLMDEPLOY_CACHE_DIR") or "~/.cache/llmdeploy").expanduser()


def gguf_cache_key(gguf: Path) -> str:
    st = gguf.stat()
    ident = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{FORMAT_VERSION}"
    return hashlib.sha256(ident.encode()).hexdigest()[:16]


def cached_gguf_folder(gguf: Path) -> Path:
    return cache_root() / "gguf" / f"{gguf.stem}-{gguf_cache_key(gguf)}"


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE).is_file()


def ensure_converted(gguf: Path) -> Path:
    """-> a Hugging Face folder holding the dequantized model; converts on the first call only."""
    final = cached_gguf_folder(gguf)
    if is_complete(final):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        log.info("converting %s into %s (first start of this GGUF file)", gguf, final)
        convert_gguf(gguf, tmp)
        (tmp / COMPLETE).write_text(f"{gguf.resolve()}\n")
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_complete(final):  # a leftover without the marker (a crash mid-rename cannot make one)
                shutil.rmtree(final, ignore_errors=True)
                os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # another start won the race, or the conversion failed
    return final


def convert_gguf(gguf: Path, out: Path) -> None:
    """transformers dequantizes the GGUF file; its weights, config, tokenizer and generation config go to `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf.parent, gguf.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, output_loading_info=True
        )
        tied = head_is_tied(gguf)
    except Exception as e:  # transformers raises many types for files it cannot read
        raise GGUFConversionError(f"cannot read GGUF file {gguf}: {type(e).__name__}: {e}") from e
    config = model.config
    # The file decides whether the head is the embedding matrix (llama.cpp writes output.weight only when it
    # is not). transformers once left lm_head untied and randomly initialised (issue 11): never cache that.
    config.tie_word_embeddings = tied
    missing = set(info.get("missing_keys") or ()) - ({"lm_head.weight"} if tied else set())
    if missing:
        raise GGUFConversionError(
            f"cannot convert GGUF file {gguf}: weights missing after loading: {sorted(missing)}"
        )
    out.mkdir(parents=True)
    config.architectures = [type(model).__name__]
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the copy is plain float32, not a GGUF-quantized model
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if tied:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)


def head_is_tied(gguf: Path) -> bool:
    """True when the GGUF file has no separate output projection (the head is the token embedding)."""
    from gguf import GGUFReader

    return all(t.name != "output.weight" for t in GGUFReader(str(gguf)).tensors)
