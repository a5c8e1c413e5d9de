"""The image and the chart agree: the Dockerfile builds every package, on a CUDA base, with
the ports, user and model directory the chart's defaults expect."""

from __future__ import annotations

import re
import tomllib

import yaml

from tests.unit.helm.chart import CHART

ROOT = CHART.parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def _instructions(name: str) -> list[str]:
    return re.findall(rf"^{name}\s+(.+)$", DOCKERFILE, flags=re.MULTILINE)


def test_base_image_is_cuda() -> None:
    (default,) = re.findall(r"^ARG CUDA_IMAGE=(\S+)$", DOCKERFILE, flags=re.MULTILINE)
    assert default.startswith("nvidia/cuda:") and "runtime" in default
    assert all(line.startswith("${CUDA_IMAGE}") for line in _instructions("FROM"))


def test_every_package_is_copied_into_the_build() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    copied = {line.split()[0] for line in _instructions("COPY") if "--from" not in line}
    for pattern in include:
        package = pattern.rstrip("*")
        # Generated stubs (the `pdserve` package) live under protos/.
        source = "protos" if package == "pdserve" else package
        assert source in copied, f"Dockerfile does not COPY {source}/"
    assert {"pyproject.toml"} <= {w for line in _instructions("COPY") for w in line.split()}


def test_ports_user_and_model_dir_match_the_chart_defaults() -> None:
    (exposed,) = _instructions("EXPOSE")
    ports = {*VALUES["ports"].values(), VALUES["gateway"]["http"]["port"]}
    assert {int(p) for p in exposed.split()} == ports
    (user,) = _instructions("USER")
    assert user.split(":")[0] == str(VALUES["podSecurityContext"]["runAsUser"])
    assert f"PDSERVE_MODEL_CACHE_DIR={VALUES['model']['cacheDir']}" in DOCKERFILE
    assert f"--model-cache-dir {VALUES['model']['cacheDir']}" in DOCKERFILE
    assert _instructions("ENTRYPOINT") == ['["pdserve"]']
