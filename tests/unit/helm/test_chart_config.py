"""The chart's configuration matches the code: every `PDSERVE_*` variable it sets is a
flag of the command the container runs, and the real CLI parses and validates it.

The accepted set is derived from the config dataclasses each subcommand registers
(`services.common.config.env_var_names`), so a renamed or removed flag fails here
instead of being silently ignored by a pod.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.common.config import ENV_PREFIX, config_from_args, env_var_names
from tests.unit.helm.chart import (
    CHART,
    VALUE_SETS,
    Manifest,
    command_configs,
    component,
    config_fields,
    container_env,
    is_pdserve,
    load_values,
    pod_templates,
    render,
)

pytest.importorskip("helm_python")

CASES: list[Path | None] = [None, *VALUE_SETS]
IDS = ["defaults", *(p.name.removesuffix("-values.yaml") for p in VALUE_SETS)]
#: Which schema section's `config` map feeds which subcommand.
SCHEMA_SECTIONS = {"gateway": "gateway", "router": "router", "prefill": "worker",
                   "decode": "worker", "routing": "router"}  # fmt: skip


@pytest.fixture(scope="module")
def configs() -> dict[str, list[type]]:
    found = command_configs()
    for command in ("worker", "gateway", "router"):
        assert found.get(command), f"`pdserve {command}` registers no config dataclass"
    return found


def subcommand(container: Manifest) -> str:
    args = list(container["args"])
    if args[:1] == ["--log-level"]:
        args = args[2:]
    return str(args[0])


def service_containers(docs: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    for workload, pod in pod_templates(docs):
        for c in filter(is_pdserve, pod["containers"]):
            yield component(workload), c


def unknown_env(docs: list[Manifest], configs: dict[str, list[type]]) -> dict[str, set[str]]:
    """PDSERVE_* variables a container gets that its command does not accept."""
    problems: dict[str, set[str]] = {}
    for name, c in service_containers(docs):
        accepted = {v for cls in configs[subcommand(c)] for v in env_var_names(cls)}
        bad = {k for k in container_env(docs, c) if k.startswith(ENV_PREFIX)} - accepted
        if bad:
            problems[name] = bad
    return problems


@pytest.mark.parametrize("values_file", CASES, ids=IDS)
def test_every_pdserve_env_var_is_a_flag_of_the_command(
    values_file: Path | None, configs: dict[str, list[type]]
) -> None:
    docs = render(load_values(values_file))
    assert len(list(service_containers(docs))) >= 3
    assert unknown_env(docs, configs) == {}


def test_an_unknown_flag_in_values_is_caught(configs: dict[str, list[type]]) -> None:
    docs = render({"gateway": {"config": {"no_such_flag": 1}}})
    assert unknown_env(docs, configs) == {"gateway": {"PDSERVE_NO_SUCH_FLAG"}}


@pytest.mark.parametrize("values_file", CASES, ids=IDS)
def test_the_real_cli_parses_and_validates_each_container(
    values_file: Path | None, configs: dict[str, list[type]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.cli.main import build_parser

    docs = render(load_values(values_file))
    for name, c in service_containers(docs):
        env = container_env(docs, c)
        with monkeypatch.context() as m:
            for key in [k for k in os.environ if k.startswith(ENV_PREFIX)]:
                m.delenv(key)
            for key, value in env.items():
                m.setenv(key, value)
            args = build_parser().parse_args(list(c["args"]))
            classes = configs[subcommand(c)]
            built: dict[str, Any] = {k.__name__: config_from_args(k, args) for k in classes}
        _check_wiring(name, built, env)


def _check_wiring(name: str, built: dict[str, Any], env: dict[str, str]) -> None:
    if name in ("prefill", "decode"):
        worker = built["WorkerConfig"]
        assert worker.role in (name, "mixed") and worker.host == "10.1.2.3"
        assert worker.worker_id == env["PDSERVE_WORKER_ID"] and worker.port > 0
        assert built["TransferConfig"].kv_transfer_host == "10.1.2.3"
        assert worker.redis_url == env["PDSERVE_REDIS_URL"]
    elif name == "gateway":
        gateway = built["GatewayConfig"]
        assert gateway.placement == "redis" and gateway.gateway_host == "0.0.0.0"
        assert built["RouterConfig"].redis_url == env["PDSERVE_REDIS_URL"]
    else:
        assert built["RouterConfig"].redis_url == env["PDSERVE_REDIS_URL"]


@pytest.mark.parametrize("values_file", CASES, ids=IDS)
def test_settings_the_cluster_shares_agree(values_file: Path | None) -> None:
    docs = render(load_values(values_file))
    envs = {name: container_env(docs, c) for name, c in service_containers(docs)}
    for key in ("PDSERVE_BLOCK_SIZE", "PDSERVE_NAMESPACE", "PDSERVE_HEARTBEAT_TTL_S",
                "PDSERVE_REDIS_URL"):  # fmt: skip
        assert len({env[key] for env in envs.values()}) == 1, key
    backends = {env["PDSERVE_KV_BACKEND"] for n, env in envs.items() if n in ("prefill", "decode")}
    assert len(backends) == 1


def test_config_layers_and_number_formatting() -> None:
    docs = render({
        "routing": {"policy": "consistent", "eps": 0.5},
        "gateway": {"config": {"policy": "round_robin", "max_streams": 9}},
        "prefill": {"config": {"kv_cache_bytes": 17179869184, "dtype": "bfloat16"}},
    })  # fmt: skip
    envs = dict(service_containers(docs))
    gateway, router = container_env(docs, envs["gateway"]), container_env(docs, envs["router"])
    assert gateway["PDSERVE_POLICY"] == "round_robin" and router["PDSERVE_POLICY"] == "consistent"
    assert gateway["PDSERVE_EPS"] == router["PDSERVE_EPS"] == "0.5"
    prefill = container_env(docs, envs["prefill"])
    # YAML numbers reach templates as floats; a byte count must not become 1.7e+10.
    assert prefill["PDSERVE_KV_CACHE_BYTES"] == "17179869184"
    assert prefill["PDSERVE_DEVICE"] == "cuda" and prefill["PDSERVE_DTYPE"] == "bfloat16"


def test_schema_reserved_keys_are_real_flags(configs: dict[str, list[type]]) -> None:
    """The keys the schema keeps for the chart's own wiring exist in the code."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    for section, command in SCHEMA_SECTIONS.items():
        node = schema["properties"][section]
        node = node.get("properties", {}).get("config", node)
        reserved = set(node["propertyNames"]["not"]["enum"])
        fields = config_fields(configs[command])
        # Telemetry flags are reserved for every component; the rest must be real.
        missing = reserved - fields - {"otlp_endpoint", "pod_name", "metrics_host", "metrics_port"}
        assert not missing, f"{section}: {missing}"
