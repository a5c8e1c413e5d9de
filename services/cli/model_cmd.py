"""`pdserve model prepare|info`: convert the default model once, or describe a model dir."""

from __future__ import annotations

import argparse
from pathlib import Path

from engine.model_spec import ModelSpec
from engine.model_store import resolve_model_dir
from services.common.config import add_config_args, config_from_args
from services.common.model_config import ModelConfig


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser("model", help="prepare or inspect the model")
    actions = parser.add_subparsers(dest="action", required=True)
    prepare = actions.add_parser("prepare", help="convert the default GGUF to HF layout (once)")
    add_config_args(prepare, ModelConfig)
    prepare.set_defaults(handler=_prepare)
    info = actions.add_parser("info", help="print the model's shape and fingerprint")
    add_config_args(info, ModelConfig)
    info.set_defaults(handler=_info)


def _resolve(args: argparse.Namespace) -> Path:
    cfg = config_from_args(ModelConfig, args)
    return resolve_model_dir(cfg.model, cfg.model_cache_dir.expanduser(), progress=True)


def _prepare(args: argparse.Namespace) -> int:
    print(_resolve(args))
    return 0


def _info(args: argparse.Namespace) -> int:
    model_dir = _resolve(args)
    spec = ModelSpec.from_dir(model_dir)
    print(f"path: {model_dir}")
    for name in (
        "model_type",
        "num_layers",
        "hidden_size",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "fingerprint",
    ):
        print(f"{name}: {getattr(spec, name)}")
    if spec.identity is not None:  # what the fingerprint folds, for telling copies apart
        for part, digest in spec.identity.to_json().items():
            print(f"identity.{part}: {digest}")
    return 0
