"""The settings the headline and the shifting workload share are declared once
(`SharedSettings`), while both configs keep their flat fields: the same flags and env
vars, the same defaults, and the same keys, in the same order, in a result's `config`."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import pytest

from engine.precision import DType
from loadtest.headline.config import HeadlineConfig, SharedSettings, shared_field
from loadtest.headline.shifting_config import ShiftingConfig
from loadtest.reports.result_file import jsonable
from services.common.config import add_config_args, config_from_args, env_var_names

SHIFTING_JSON = (
    Path(__file__).resolve().parents[3] / "docs/results/elastic/issue41/shifting/shifting.json"
)
#: The `config` object of headline.json and shifting.json before the shared settings.
HEADLINE_KEYS = [
    "systems", "rates", "start_rate", "max_probes", "bisect_steps", "min_rate", "max_rate",
    "local_prefill_max_tokens", "elastic_roles", "num_requests", "duration_s",
    "request_timeout_s", "warmup_requests", "stop_below_attainment", "short_rate",
    "chat_search", "short_num_requests", "short_duration_s", "ttft_slo_ms",
    "ttft_slo_ms_per_token", "itl_slo_ms", "itl_slo_quantile", "attainment_target",
    "target_ratio", "pin_workers", "dtype", "kv_backend", "worker_kv_cache_bytes", "out_dir",
    "progress",
]  # fmt: skip
SHIFTING_KEYS = [
    "systems", "phases", "rate_scales", "rounds", "target_ratio", "attainment_target",
    "request_timeout_s", "warmup_requests", "ttft_slo_ms", "ttft_slo_ms_per_token",
    "itl_slo_ms", "itl_slo_step_factor", "itl_slo_quantile", "local_prefill_max_tokens",
    "pin_workers", "dtype", "kv_backend", "worker_kv_cache_bytes", "out_dir", "progress",
]  # fmt: skip
#: Defaults that differ between the two: each config's own.
OWN = {
    HeadlineConfig: {"systems": "disaggregated,colocated", "warmup_requests": 3,
                     "itl_slo_ms": 250.0, "target_ratio": 1.5, "out_dir": "bench-results"},
    ShiftingConfig: {"systems": "elastic,static,colocated", "warmup_requests": 4,
                     "itl_slo_ms": 0.0, "target_ratio": 1.2, "out_dir": "bench-results/shifting"},
}  # fmt: skip
SHARED = {
    "request_timeout_s": 120.0, "ttft_slo_ms": 2000.0, "ttft_slo_ms_per_token": 12.0,
    "itl_slo_quantile": 0.9, "attainment_target": 0.9, "local_prefill_max_tokens": 512,
    "pin_workers": True, "dtype": None, "kv_backend": "nixl", "worker_kv_cache_bytes": 1 << 30,
    "progress": True,
}  # fmt: skip
CONFIGS: list[type[HeadlineConfig] | type[ShiftingConfig]] = [HeadlineConfig, ShiftingConfig]


def _config_json(cfg: HeadlineConfig | ShiftingConfig) -> dict[str, object]:
    """The `config` object a result file holds (`result_file.write_result`)."""
    data = json.loads(json.dumps(jsonable(dataclasses.asdict(cfg))))
    assert isinstance(data, dict)
    return data


@pytest.mark.parametrize(("cls", "keys"), [(HeadlineConfig, HEADLINE_KEYS),
                                           (ShiftingConfig, SHIFTING_KEYS)])  # fmt: skip
def test_the_json_keys_and_defaults_are_as_before(cls: type, keys: list[str]) -> None:
    data = _config_json(cls())
    assert list(data) == keys
    assert {k: data[k] for k in SHARED} == SHARED
    assert {k: data[k] for k in OWN[cls]} == OWN[cls]


def test_the_committed_shifting_result_has_the_same_config_keys() -> None:
    committed = json.loads(SHIFTING_JSON.read_text())["config"]
    assert list(committed) == list(_config_json(ShiftingConfig()))


@pytest.mark.parametrize("cls", CONFIGS)
def test_the_flags_and_env_vars_are_the_fields(cls: type) -> None:
    keys = HEADLINE_KEYS if cls is HeadlineConfig else SHIFTING_KEYS
    assert env_var_names(cls) == [f"PDSERVE_{k.upper()}" for k in keys]
    parser = argparse.ArgumentParser()
    add_config_args(parser, cls, env={})
    argv = ["--pin-workers", "false", "--dtype", "bfloat16", "--request-timeout-s", "30",
            "--local-prefill-max-tokens", "0", "--kv-backend", "tcp"]  # fmt: skip
    cfg: HeadlineConfig | ShiftingConfig = config_from_args(cls, parser.parse_args(argv))
    assert (cfg.pin_workers, cfg.dtype, cfg.request_timeout_s) == (False, DType.BFLOAT16, 30.0)
    assert (cfg.local_prefill_max_tokens, cfg.kv_backend) == (0, "tcp")
    assert config_from_args(cls, parser.parse_args([])) == cls()


def test_a_shared_field_keeps_each_benchmarks_help() -> None:
    helps = {cls: {f.name: f.metadata["help"] for f in dataclasses.fields(cls)} for cls in CONFIGS}
    assert helps[HeadlineConfig]["attainment_target"] == (
        "attainment that defines a deployment's capacity"
    )
    assert helps[ShiftingConfig]["attainment_target"] == (
        "attainment that defines a capacity (a sweep)"
    )
    for name in ("pin_workers", "dtype", "kv_backend", "worker_kv_cache_bytes"):
        assert helps[HeadlineConfig][name] == helps[ShiftingConfig][name]
    with pytest.raises(ValueError, match="not a SharedSettings field"):
        shared_field("rounds")


@pytest.mark.parametrize("cls", CONFIGS)
def test_both_check_the_shared_settings_once_declared(cls: type) -> None:
    cfg = cls(pin_workers=False, dtype=DType.BFLOAT16)
    shared = SharedSettings.of(cfg)
    assert (shared.pin_workers, shared.dtype) == (False, DType.BFLOAT16)
    assert dataclasses.asdict(SharedSettings.of(cls())) == SHARED
    for bad in ({"request_timeout_s": 0.0}, {"attainment_target": 0.0},
                {"local_prefill_max_tokens": -1}, {"ttft_slo_ms": 0.0}):  # fmt: skip
        with pytest.raises(ValueError):
            cls(**bad)


def test_each_slo_takes_the_shared_parts() -> None:
    headline = HeadlineConfig(ttft_slo_ms=1500.0, itl_slo_quantile=0.5).slo
    assert (headline.ttft_ms, headline.itl_ms, headline.itl_quantile) == (1500.0, 250.0, 0.5)
    shifting = ShiftingConfig(ttft_slo_ms=1500.0, itl_slo_quantile=0.5).slo(100.0)
    assert (shifting.ttft_ms, shifting.itl_ms, shifting.itl_quantile) == (1500.0, 300.0, 0.5)
