"""Flags and PDSERVE_* env vars derived from config dataclasses."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from engine.config import EngineConfig
from engine.precision import DType
from services.common.config import (
    add_config_args,
    config_from_args,
    config_from_env,
    config_with_args,
    env_var_names,
)
from services.gateway.config import GatewayConfig
from services.worker.config import WorkerConfig


def _parse(argv: list[str], env: dict[str, str]) -> EngineConfig:
    parser = argparse.ArgumentParser()
    add_config_args(parser, EngineConfig, env=env)
    return config_from_args(EngineConfig, parser.parse_args(argv))


def test_flag_beats_env_beats_default() -> None:
    assert _parse([], {}).block_size == 16
    assert _parse([], {"PDSERVE_BLOCK_SIZE": "32"}).block_size == 32
    assert _parse(["--block-size", "64"], {"PDSERVE_BLOCK_SIZE": "32"}).block_size == 64


def test_optional_and_path_fields() -> None:
    cfg = _parse(
        ["--num-kv-blocks", "100", "--model-cache-dir", "/tmp/x"], {"PDSERVE_MODEL": "none"}
    )
    assert cfg.num_kv_blocks == 100 and cfg.model_cache_dir == Path("/tmp/x") and cfg.model is None


def test_bad_env_value_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse([], {"PDSERVE_BLOCK_SIZE": "sixteen"})
    assert "PDSERVE_BLOCK_SIZE" in capsys.readouterr().err


def test_validation_runs_on_the_built_config() -> None:
    with pytest.raises(ValueError, match="block_size"):
        _parse(["--block-size", "12"], {})
    with pytest.raises(ValueError, match="role"):
        WorkerConfig(role="chef")


def test_env_names_cover_every_field() -> None:
    names = env_var_names(WorkerConfig)
    assert "PDSERVE_ROLE" in names and "PDSERVE_REDIS_URL" in names
    assert all(n.startswith("PDSERVE_") and n.isupper() for n in names)


def test_gateway_guardrail_flags_and_env_vars() -> None:
    parser = argparse.ArgumentParser()
    env = {"PDSERVE_SLOW_CLIENT_TIMEOUT_S": "2.5", "PDSERVE_STREAM_BUFFER_MESSAGES": "8"}
    add_config_args(parser, GatewayConfig, env=env)
    args = parser.parse_args(["--decode-workers", "d:1", "--max-tokens-limit", "512"])
    cfg = config_from_args(GatewayConfig, args)
    assert (cfg.max_tokens_limit, cfg.slow_client_timeout_s, cfg.stream_buffer_messages) == (
        512, 2.5, 8,
    )  # fmt: skip
    assert cfg.request_deadline_s == 600.0
    for name in ("max_tokens_limit", "request_deadline_s", "slow_client_timeout_s",
                 "stream_buffer_messages"):  # fmt: skip
        with pytest.raises(ValueError, match=name):
            GatewayConfig(decode_workers="d:1", **{name: 0})  # type: ignore[arg-type]


def test_config_with_args_layers_flags_on_a_built_config() -> None:
    """What the Ray controller does with `--gateway-args`: the config's own values stay
    unless a flag names them; a flag the class lacks, or a bad value, is refused by name."""
    base = GatewayConfig(placement="redis", max_streams=7)
    got = config_with_args(base, ["--ttft-budget-standard-s", "30"])
    assert (got.ttft_budget_standard_s, got.max_streams) == (30.0, 7)
    assert config_with_args(base, []) == base
    with pytest.raises(ValueError, match="no flag '--num-prefill'"):
        config_with_args(base, ["--num-prefill", "2"])
    with pytest.raises(ValueError, match="ttft-budget-standard-s"):
        config_with_args(base, ["--ttft-budget-standard-s", "soon"])


def test_config_from_env_fills_what_values_leave_unset() -> None:
    env = {"PDSERVE_BLOCK_SIZE": "32", "PDSERVE_DTYPE": "bfloat16", "PDSERVE_MAX_NUM_SEQS": "7"}
    cfg = config_from_env(EngineConfig, {"max_num_seqs": 3}, env)
    assert (cfg.block_size, cfg.dtype, cfg.max_num_seqs) == (32, DType.BFLOAT16, 3)
    assert config_from_env(EngineConfig, {}, {}).block_size == 16
    with pytest.raises(ValueError, match="PDSERVE_BLOCK_SIZE='big'"):
        config_from_env(EngineConfig, {}, {"PDSERVE_BLOCK_SIZE": "big"})
