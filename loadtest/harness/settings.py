"""What every benchmark run shares (`RunSettings`), and the parsing of list-valued flags.

Lifecycle: `bench_main.parse_args` adds the `RunSettings` fields a benchmark takes as
flags (`--out`, `--seed`, `--model`, `--model-cache-dir`; each with its `PDSERVE_*` env
var, through `services.common.config`), builds the settings once per run, fills in the
benchmark's default `out`, and passes them to the benchmark with its own config. A
benchmark's own config holds only its own knobs; list-valued knobs are comma-separated
strings (a flag and an env var are one string) with a property that parses them with the
helpers here, so a bad list fails when the config is built.

This is config code: the one place in loadtest that reads the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from engine.config import DEFAULT_MODEL_CACHE

#: Environment variables of the KV transports: a transfer result records them.
TRANSPORT_ENV_PREFIXES = ("UCX_", "NIXL_")


@dataclass(frozen=True)
class RunSettings:
    out: Path | None = field(
        default=None,
        metadata={"help": "result JSON (default: bench-results/<benchmark>.json)"},
    )
    seed: int = field(default=0, metadata={"help": "seed of the workload's random draws"})
    model: str | None = field(
        default=None, metadata={"help": "HF-layout model dir (default: SmolLM2-135M-Instruct)"}
    )
    model_cache_dir: Path = field(
        default=DEFAULT_MODEL_CACHE, metadata={"help": "where the default model is converted to"}
    )

    @property
    def out_path(self) -> Path:
        """`out`, which `bench_main.parse_args` always fills in."""
        if self.out is None:
            raise ValueError("no output path: build RunSettings through bench_main.parse_args")
        return self.out


def parse_names(text: str, name: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """'a,b' -> ('a', 'b'): at least one, each among `allowed`."""
    names = tuple(part.strip() for part in text.split(",") if part.strip())
    if not names or any(n not in allowed for n in names):
        raise ValueError(f"{name} must be among {', '.join(allowed)} (comma-separated), "
                         f"got {text!r}")  # fmt: skip
    return names


def parse_ints(text: str, name: str, *, count: int | None = None) -> tuple[int, ...]:
    """'512,2048' -> (512, 2048): positive integers, exactly `count` of them if given."""
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0 or (count is not None and len(values) != count):
        wanted = f"{count} integers" if count is not None else "integers"
        raise ValueError(f"{name} must be {wanted}, all > 0, got {text!r}")
    return values


def parse_numbers(text: str, kind: type[int] | type[float], name: str) -> list[float]:
    """'0.5,1' -> [0.5, 1.0]: at least one number, all > 0 (`kind` int rejects '0.5')."""
    try:
        values = [float(kind(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"{name} must be comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise ValueError(f"{name} must hold at least one value, all > 0, got {text!r}")
    return values


def recorded_env(
    prefixes: tuple[str, ...], environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The variables with these prefixes (child processes inherit them): for the record."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in sorted(env.items()) if k.startswith(prefixes)}
