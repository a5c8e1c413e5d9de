"""How a LoRA adapter is named and identified, without reading its tensors.

Gateways, routers and the KV hand-off name adapters and compare their identities; only
workers read the weights (`engine.lora`). This module holds what both need, so a
process that never computes does not import torch: the file names of PEFT's format, the
legal names, `AdapterRef`, and `adapter_digest`, the identity that is folded into the
prefix-block hashes and router keys of an adapter's requests and checked at a KV
hand-off.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import xxhash

from engine.errors import AdapterFormatError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: adapter_config.json keys that say where or by what the adapter was saved, not what it
#: computes: they stay out of the digest.
CONFIG_NOISE = ("base_model_name_or_path", "revision", "peft_version", "inference_mode")
#: A legal adapter name: it travels in the OpenAI `model` field as "base:adapter".
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class AdapterRef:
    """How a request names its adapter: by name, and optionally by the digest the caller
    expects (a gateway's routing key, or an exporter's KV, were made for that copy)."""

    name: str
    digest: str = ""  # "": whichever copy the engine holds


def adapter_path(directory: Path, name: str) -> Path | None:
    """`directory/name` when `name` may name an adapter and holds an adapter config there;
    else None."""
    path = directory / name
    return path if NAME.match(name) and (path / CONFIG_FILE).is_file() else None


def available_adapters(directory: Path | None) -> list[str]:
    """The adapter names under `directory`: its subdirectories holding an
    adapter_config.json whose names may name an adapter (sorted)."""
    if directory is None or not directory.is_dir():
        return []
    return sorted(p.name for p in directory.iterdir() if adapter_path(directory, p.name))


def check_adapter_name(name: str) -> str:
    """`name` if it may name an adapter; else AdapterFormatError saying what may."""
    if not NAME.match(name):
        raise AdapterFormatError(
            f"adapter name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def adapter_digest(path: Path) -> str:
    """The adapter's identity: xxh3-128 over its config (less `CONFIG_NOISE`) and the
    bytes of its weights file. AdapterFormatError if either is missing or unreadable."""
    h = digest_start(read_config(path))
    with weights_file(path).open("rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def digest_start(config: Mapping[str, object]) -> xxhash.xxh3_128:
    """The digest of `config`, ready to take the weights file's bytes."""
    canonical = json.dumps(
        {k: v for k, v in config.items() if k not in CONFIG_NOISE}, sort_keys=True
    )
    h = xxhash.xxh3_128()
    h.update(f"pdserve-lora-v1|{canonical}|".encode())
    return h


def read_config(path: Path) -> dict[str, object]:
    """The adapter's config as a dict; AdapterFormatError naming what is wrong."""
    file = path / CONFIG_FILE
    try:
        config = json.loads(file.read_text("utf-8"))
    except FileNotFoundError as exc:
        raise AdapterFormatError(f"adapter {path.name!r}: no {CONFIG_FILE} in {path}") from exc
    except (OSError, ValueError) as exc:
        raise AdapterFormatError(f"adapter {path.name!r}: cannot read {file}: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterFormatError(f"adapter {path.name!r}: {file} is not a JSON object")
    return config


def weights_file(path: Path) -> Path:
    """The adapter's safetensors file; AdapterFormatError when it is absent or pickled."""
    file = path / WEIGHTS_FILE
    if file.is_file():
        return file
    if (path / "adapter_model.bin").is_file():
        raise AdapterFormatError(
            f"adapter {path.name!r}: only safetensors weights are read (pickled "
            f"adapter_model.bin is not); save it with safe_serialization=True"
        )
    raise AdapterFormatError(f"adapter {path.name!r}: no {WEIGHTS_FILE} in {path}")
