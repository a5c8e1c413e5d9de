"""Which model a process serves: a model directory, or the default one and its cache.

Shared by every process that loads or tokenizes the model (workers, gateway, launchers,
`pdserve model`); each builds it from its flags and resolves it once at start.
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
