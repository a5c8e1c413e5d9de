"""Rendering the Helm chart with the real Helm engine, and reading what it produced.

`render(values)` runs Helm's template engine (the `helm-python-sdk` wheel embeds it) on
`helm/pdserve` and returns every manifest as a dict. The rest are small readers over
those manifests: pod specs, containers, and the environment a container would see
(ConfigMaps and Secrets resolved, downward-API fields given sample values).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

CHART = Path(__file__).resolve().parents[3] / "helm" / "pdserve"
VALUE_SETS = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE = "rel"
NAMESPACE = "serving"
#: What the downward API would give a pod; a worker binds and advertises its pod IP.
FIELD_SAMPLES = {
    "status.podIP": "10.1.2.3",
    "metadata.name": "rel-pdserve-decode-7d9f-abcde",
    "metadata.namespace": NAMESPACE,
}
#: The URL an operator's own Secret would hold (its content is not in the chart).
EXISTING_SECRET_URL = (
    "rediss://:pw@redis.internal:6380/0?ssl_ca_certs=/etc/pdserve/redis-tls/ca.crt"
)
POD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job")
Manifest = dict[str, Any]


def load_values(path: Path | None) -> dict[str, Any] | None:
    return None if path is None else yaml.safe_load(path.read_text())


def render(values: dict[str, Any] | None = None) -> list[Manifest]:
    """Every manifest the chart renders for `values` (NOTES.txt excluded)."""
    import helm_python

    chart = helm_python.Chart.load(str(CHART))
    files = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    docs: list[Manifest] = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(d for d in yaml.safe_load_all(text) if d)
    return docs


def notes(values: dict[str, Any] | None = None) -> str:
    import helm_python

    files = helm_python.Chart.load(str(CHART)).render(values, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in files.items() if path.endswith("NOTES.txt"))


def by_kind(docs: list[Manifest], kind: str) -> list[Manifest]:
    return [d for d in docs if d["kind"] == kind]


def named(docs: list[Manifest], kind: str, name: str) -> Manifest:
    matches = [d for d in by_kind(docs, kind) if d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def component(doc: Manifest) -> str:
    return str(doc["metadata"]["labels"]["app.kubernetes.io/component"])


def pod_templates(docs: list[Manifest]) -> Iterator[tuple[Manifest, Manifest]]:
    """(workload, pod spec) for every object that runs pods."""
    for doc in docs:
        if doc["kind"] in POD_KINDS:
            yield doc, doc["spec"]["template"]["spec"]


def containers(pod: Manifest) -> list[Manifest]:
    return list(pod.get("initContainers", [])) + list(pod["containers"])


def is_pdserve(container: Manifest) -> bool:
    return container.get("command", [None])[0] == "pdserve"


def container_env(docs: list[Manifest], container: Manifest) -> dict[str, str]:
    """The environment the container starts with: envFrom first, then env (which wins)."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        ref = source["configMapRef"]["name"]
        env.update(named(docs, "ConfigMap", ref).get("data", {}))
    for item in container.get("env", []):
        env[item["name"]] = _env_value(docs, item)
    return env


def _env_value(docs: list[Manifest], item: Manifest) -> str:
    if "value" in item:
        return str(item["value"])
    source = item["valueFrom"]
    if "fieldRef" in source:
        return FIELD_SAMPLES[source["fieldRef"]["fieldPath"]]
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        secrets = [d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == ref["name"]]
        if not secrets:  # an operator's Secret, outside the chart
            return EXISTING_SECRET_URL
        return str(secrets[0]["stringData"][ref["key"]])
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return str(named(docs, "ConfigMap", ref["name"])["data"][ref["key"]])
    raise AssertionError(f"unhandled env source {source}")


def command_configs() -> dict[str, list[type]]:
    """The config dataclasses each `pdserve` subcommand registers, as the CLI builds them.

    Every `add_config_args` imported by a loaded `services` module is wrapped for the
    duration of one `build_parser()` call, so the answer comes from the code itself
    (services/cli/serve_cmd.py and friends), not from a list kept here.
    """
    import services.cli.main as cli_main
    from services.common import config as config_mod

    real = config_mod.add_config_args
    seen: dict[str, list[type]] = {}

    def spy(parser: argparse.ArgumentParser, cls: type, **kwargs: Any) -> None:
        seen.setdefault(parser.prog.split()[-1], []).append(cls)
        real(parser, cls, **kwargs)

    patched = [
        m for name, m in list(sys.modules.items())
        if name.startswith("services") and getattr(m, "add_config_args", None) is real
    ]  # fmt: skip
    for module in patched:
        module.add_config_args = spy  # type: ignore[attr-defined]
    try:
        cli_main.build_parser()
    finally:
        for module in patched:
            module.add_config_args = real  # type: ignore[attr-defined]
    return seen


def config_fields(classes: list[type]) -> set[str]:
    return {f.name for cls in classes for f in dataclasses.fields(cls)}
