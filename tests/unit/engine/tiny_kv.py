"""A KV cache small enough to build in a unit test: 4-token blocks of one 4-wide head,
float32 on the CPU. For tests of the offload tier and of what holds blocks, where the
bytes only need to exist and be copied."""

from __future__ import annotations

import torch

from engine.kv_cache import KvCache
from engine.kv_layout import KvLayout


def tiny_kv_cache(blocks: int, num_layers: int = 2) -> KvCache:
    layout = KvLayout(model_fingerprint="m", dtype="float32", block_size=4,
                      num_layers=num_layers, num_kv_heads=1, head_dim=4,
                      memory_kind="cpu")  # fmt: skip
    return KvCache(layout, blocks, torch.device("cpu"))
