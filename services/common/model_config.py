"""Which model a process serves: a model directory, or the default one and its cache.

Shared by every process that loads or tokenizes the model (workers, gateway, launchers,
`pdserve model`); each builds it from its flags and resolves it once at start. Also the
rules for the names a cluster serves models under (`--served-model-name`,
`--extra-models`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.config import DEFAULT_MODEL_CACHE


@dataclass(frozen=True)
class ModelConfig:
    model: str | None = field(
        default=None, metadata={"help": "HF-layout model dir (default: SmolLM2-135M-Instruct)"}
    )
    model_cache_dir: Path = field(
        default=DEFAULT_MODEL_CACHE, metadata={"help": "where the default model is converted to"}
    )


#: Characters a served model name or version may not hold: they separate the parts of a
#: pool namespace, a flag's list, or a Redis key.
_RESERVED = frozenset("/@:,= \t\n")


def check_model_name(value: str, what: str) -> str:
    """`value`, or ValueError naming `what` when it holds a reserved character."""
    bad = sorted(set(value) & _RESERVED)
    if bad:
        raise ValueError(f"{what} must not contain {' '.join(map(repr, bad))}: got {value!r}")
    return value


def extra_model_dirs(text: str) -> dict[str, str]:
    """An `--extra-models` list, comma-separated NAME=MODEL_DIR, as name -> directory in
    order; ValueError naming the entry that is not one, or a name given twice."""
    out: dict[str, str] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        name, sep, path = entry.partition("=")
        if not (sep and name.strip() and path.strip()):
            raise ValueError(f"extra_models: {entry!r} is not NAME=MODEL_DIR")
        name = check_model_name(name.strip(), "extra_models name")
        if name in out:
            raise ValueError(f"extra_models: {name!r} is listed twice")
        out[name] = path.strip()
    return out
