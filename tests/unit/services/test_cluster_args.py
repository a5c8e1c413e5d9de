"""The flags `pdserve up` gives its workers for precision: none unless asked, so each
worker keeps its own default (its PDSERVE_DTYPE env, which the test suite pins to
float32); when asked, the same dtype, quantization and KV cache dtype for every worker.
And the model names: the primary's to the gateway and its workers, each extra model's to
its own worker. The LoRA adapters: to the gateway and the primary model's workers."""

from __future__ import annotations

from engine.precision import DType, KvCacheDType, WeightQuant
from services.cluster.config import ClusterConfig
from services.cluster.local_cluster import LocalCluster


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_unset_precision_passes_no_flag() -> None:
    args = LocalCluster(ClusterConfig(gateway_port=0))._worker_args("decode", 0)
    assert _flag(args, "--dtype") is None and _flag(args, "--quantization") is None
    assert _flag(args, "--kv-cache-dtype") is None


def test_set_precision_reaches_every_worker() -> None:
    cfg = ClusterConfig(gateway_port=0, dtype=DType.BFLOAT16, quantization=WeightQuant.INT8,
                        kv_cache_dtype=KvCacheDType.FP8_E4M3)  # fmt: skip
    cluster = LocalCluster(cfg)
    for role in ("prefill", "decode"):
        args = cluster._worker_args(role, 0)
        assert _flag(args, "--dtype") == "bfloat16"
        assert _flag(args, "--quantization") == "int8"
        assert _flag(args, "--kv-cache-dtype") == "fp8_e4m3"


def _last(args: list[str], name: str) -> str | None:
    """A repeated flag's last value: the one argparse keeps."""
    values = [args[i + 1] for i, a in enumerate(args) if a == name]
    return values[-1] if values else None


def test_model_names_reach_the_gateway_and_the_right_workers() -> None:
    cfg = ClusterConfig(gateway_port=0, placement="redis", served_model_name="smol",
                        extra_models="tiny=/models/tiny")  # fmt: skip
    cluster = LocalCluster(cfg)
    assert _last(cluster._worker_args("decode", 0), "--served-model-name") == "smol"
    extra = cluster._extra_model_args("tiny", "/models/tiny")
    assert _last(extra, "--served-model-name") == "tiny"  # its own, after the primary's
    assert _last(extra, "--model") == "/models/tiny" and _last(extra, "--role") == "mixed"
    gateway = cluster._gateway_args([], [], 0)
    assert _last(gateway, "--served-model-name") == "smol"
    assert _last(gateway, "--extra-models") == "tiny=/models/tiny"


def test_lora_dir_reaches_the_gateway_and_the_primary_models_workers() -> None:
    cfg = ClusterConfig(gateway_port=0, placement="redis", lora_dir="/loras", max_loras=3,
                        extra_models="tiny=/models/tiny")  # fmt: skip
    cluster = LocalCluster(cfg)
    for role in ("prefill", "decode"):
        args = cluster._worker_args(role, 0)
        assert _last(args, "--lora-dir") == "/loras" and _last(args, "--max-loras") == "3"
    assert _last(cluster._gateway_args([], [], 0), "--lora-dir") == "/loras"
    extra = cluster._extra_model_args("tiny", "/models/tiny")  # another base model
    assert _last(extra, "--lora-dir") is None and _last(extra, "--max-loras") is None
