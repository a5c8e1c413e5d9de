"""A test cluster whose gateway takes API keys and extra env vars: the fixture body the
guardrail and admission tests share."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import pytest

from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster
from tests.conftest import MODEL_CACHE


def keyed_cluster(
    tmp_path_factory: pytest.TempPathFactory, keys: str, gateway_env: Mapping[str, str]
) -> Iterator[LocalCluster]:
    """Start 1 prefill + 1 decode worker and a gateway reading the keys file `keys`
    (its lines), with `gateway_env` set while the children start (they inherit it);
    yield the cluster, stop it after."""
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text(keys)
    cfg = ClusterConfig(
        gateway_port=0, model_cache_dir=MODEL_CACHE, worker_kv_cache_bytes=96 << 20,
        api_keys_file=str(path),
    )  # fmt: skip
    cluster = LocalCluster(cfg)
    with pytest.MonkeyPatch.context() as env:
        for name, value in gateway_env.items():
            env.setenv(name, value)
        cluster.start()
    yield cluster
    cluster.stop()
