"""Command-line flags and `PDSERVE_*` env vars derived from typed config dataclasses.

Lifecycle: a command calls `add_config_args(parser, SomeConfig)` while building its
parser, then `config_from_args(SomeConfig, namespace)` after parsing. Every dataclass
field `foo_bar` becomes the flag `--foo-bar` and the env var `PDSERVE_FOO_BAR`; the flag
wins over the env var, which wins over the field's default. Help text comes from the
field's `metadata["help"]`. This module is the only place that reads the environment, so
the Helm chart and the code can be checked against `env_var_names`.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "PDSERVE_"
T = TypeVar("T")


def env_var(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def pdserve_env() -> dict[str, str]:
    """This process's `PDSERVE_*` env vars, for a launcher to hand to what it builds
    elsewhere (Ray actors on other nodes do not share its environment)."""
    return {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIX)}


def env_var_names(cls: type) -> list[str]:
    """Every env var a config dataclass accepts."""
    return [env_var(f.name) for f in dataclasses.fields(cls)]


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


def parse_bool(text: str) -> bool:
    """A command-line or environment boolean: 1/true/yes/on or 0/false/no/off."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _parser_for(tp: Any) -> Callable[[str], Any]:
    base, optional = _unwrap_optional(tp)
    converters: dict[Any, Callable[[str], Any]] = {
        bool: parse_bool,
        int: int,
        float: float,
        Path: Path,
    }
    convert = converters.get(base, str)
    if isinstance(base, type) and issubclass(base, enum.Enum):
        convert = base  # a flag names the member by its value: --role decode
    if not optional:
        return convert

    def parse(text: str) -> Any:
        return None if text.strip().lower() in ("", "none") else convert(text)

    return parse


def _from_env(name: str, parse: Callable[[str], Any], environ: Mapping[str, str]) -> Any:
    """The env var `name` parsed; a ValueError naming it if it does not parse."""
    try:
        return parse(environ[name])
    except (ValueError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"{name}={environ[name]!r}: {exc}") from None


def add_config_args(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    exclude: tuple[str, ...] = (),
    env: Mapping[str, str] | None = None,
) -> None:
    """Add one flag per field of `cls`; defaults come from `env` (os.environ) first."""
    environ = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        parse = _parser_for(hints[f.name])
        name = env_var(f.name)
        default = f.default
        if name in environ:
            try:
                default = _from_env(name, parse, environ)
            except ValueError as exc:
                parser.error(str(exc))
        # argparse %-formats help: a literal '%' in the text ("50% slower") must be doubled.
        text = str(f.metadata.get("help", "")).replace("%", "%%")
        help_text = f"{text} (env {name}; default: %(default)s)"
        bare = bool(f.metadata.get("bare"))  # also alone: `--autoscale` = `--autoscale true`
        group.add_argument(
            flag(f.name), dest=f.name, type=parse, default=default, help=help_text,
            nargs="?" if bare else None, const=True if bare else None,
        )  # fmt: skip


def config_from_args(cls: type[T], namespace: argparse.Namespace) -> T:
    """Build the (frozen, self-validating) config from parsed flags."""
    names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
    values = {n: getattr(namespace, n) for n in names if hasattr(namespace, n)}
    return cls(**values)


def config_from_env(
    cls: type[T], values: Mapping[str, Any], env: Mapping[str, str] | None = None
) -> T:
    """`cls` with `values`, and every other field from its `PDSERVE_*` env var where set
    (else its default): what the service's own command line would have read, for a
    launcher that builds the service in-process (Ray). A var that does not parse is a
    ValueError naming it."""
    environ = os.environ if env is None else env
    hints = typing.get_type_hints(cls)
    from_env = {
        f.name: _from_env(env_var(f.name), _parser_for(hints[f.name]), environ)
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if f.name not in values and env_var(f.name) in environ
    }
    return cls(**from_env, **values)


def config_with_args(cfg: T, argv: list[str]) -> T:
    """`cfg` with the flags in `argv` applied on top (its own values are the defaults;
    the environment is not read). A flag `cfg`'s class does not have is a ValueError
    naming it: a launcher that forwards extra flags to a service it builds in-process
    (Ray) refuses what that service would not understand instead of dropping it."""
    cls = type(cfg)
    parser = argparse.ArgumentParser(prog=cls.__name__, add_help=False, exit_on_error=False)
    add_config_args(parser, cls, env={})
    parser.set_defaults(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]
    try:
        namespace, unknown = parser.parse_known_args(argv)
    except argparse.ArgumentError as exc:
        raise ValueError(f"{cls.__name__}: {exc}") from None
    if unknown:
        raise ValueError(f"{cls.__name__} has no flag {unknown[0]!r}")
    return config_from_args(cls, namespace)


def config_args(cfg: object, **overrides: object) -> list[str]:
    """Flags that reproduce a config dataclass for a child process: one `--flag value` per
    field that differs from its default (after `overrides`), so children inherit only
    what the launcher was told."""
    args: list[str] = []
    for f in dataclasses.fields(cfg):  # type: ignore[arg-type]
        value = overrides.get(f.name, getattr(cfg, f.name))
        if value != f.default:
            args += [flag(f.name), str(value)]
    return args
