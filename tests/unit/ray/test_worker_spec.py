"""The worker actors' configs as the Ray controller builds them (no Ray cluster needed)."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.precision import DType
from services.cluster.config import ClusterConfig
from services.common.telemetry_config import TelemetryConfig
from services.ray.config import RayConfig
from services.ray.controller import ClusterController


def test_ray_worker_engines_read_the_launchers_env() -> None:
    """A Ray worker's engine takes the launcher's PDSERVE_* settings that the cluster leaves
    unset, as a local cluster's worker process does; the cluster's own choice wins."""
    env = {"PDSERVE_DTYPE": "bfloat16", "PDSERVE_MAX_NUM_SEQS": "7"}

    def engine(cluster: ClusterConfig, env: dict[str, str]) -> EngineConfig:
        controller = ClusterController(cluster, RayConfig(), TelemetryConfig(), env)
        spec = controller._worker_spec(controller.pools["decode"], 0)
        built = spec.configs[1]
        assert isinstance(built, EngineConfig)
        return built

    inherited = engine(ClusterConfig(worker_kv_cache_bytes=96 << 20), env)
    assert (inherited.dtype, inherited.max_num_seqs) == (DType.BFLOAT16, 7)
    assert inherited.kv_cache_bytes == 96 << 20
    assert engine(ClusterConfig(dtype=DType.FLOAT32), env).dtype is DType.FLOAT32
    assert engine(ClusterConfig(), {}).dtype is DType.AUTO
