"""The memory roof of a decode step: the least time reading what it must read can take.

Lifecycle: the engine builds one `DecodeRoof` at start (`for_engine`: the model's
projection and LM-head weights as stored, the KV cache's bytes per token, and the
device's read bandwidth, `--memory-bandwidth-gb-s` or measured once by
`read_bandwidth` when that is 0) and hands it to its `StepMeter`, which adds `step_s`
of every step that ran only decodes to a running total beside those steps' wall time.
Their ratio over a window (`pdserve:decode_roof_fraction:rate5m`, docs/observability.md)
is the fraction of the roof the worker reaches: near 1, decode is as fast as the memory
allows; well below, time goes to something else (Python, launch overhead, a batch too
small to hide it).

A decode step reads every projection weight and the LM head once, whatever its batch,
and each row's context from the KV cache; embeddings, norms and activations are left
out (a row's embedding is one vector, the rest fit in cache), so the roof is a lower
bound on the step's time and the fraction stays at or under 1 unless the bandwidth was
measured low. The projection shapes here are also the roofline benchmark's
(loadtest/engine/machine_roof.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.model_spec import ModelSpec

#: Bytes the start-up bandwidth probe reads: well past a server CPU's last-level cache.
PROBE_BYTES = 256 << 20
PROBE_READS = 5


@dataclass(frozen=True)
class Projection:
    rows_in: int  # the weight's input features
    rows_out: int  # its output features


def projections(spec: ModelSpec, *, lm_head: bool) -> list[Projection]:
    """One layer's projections (the step repeats them num_layers times) and the LM head."""
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    h, inter = spec.hidden_size, spec.intermediate_size
    out = [Projection(h, q + 2 * kv), Projection(q, h), Projection(h, 2 * inter),
           Projection(inter, h)]  # fmt: skip
    return [*out, Projection(h, spec.vocab_size)] if lm_head else out


def linear_flops(spec: ModelSpec, rows: int, *, lm_head: bool) -> float:
    """FLOPs (2 per multiply-add) of every projection of the model at `rows` rows."""
    layer = sum(p.rows_in * p.rows_out for p in projections(spec, lm_head=False))
    head = spec.hidden_size * spec.vocab_size if lm_head else 0
    return 2.0 * rows * (layer * spec.num_layers + head)


def linear_weight_bytes(spec: ModelSpec, element_size: float) -> float:
    """Bytes of every projection weight and the LM head, stored `element_size` wide."""
    params = linear_flops(spec, 1, lm_head=True) / 2
    return params * element_size


def read_bandwidth(device: torch.device) -> float:
    """Bytes per second of summing a `PROBE_BYTES` buffer on `device`, the best of
    `PROBE_READS` (about 0.1 s on a CPU); the buffer is freed after."""
    buf = torch.ones(PROBE_BYTES // 4, device=device)
    best = float("inf")
    for _ in range(PROBE_READS):
        start = time.perf_counter()
        buf.sum().item()  # .item() waits for a device's kernel
        best = min(best, time.perf_counter() - start)
    del buf
    return PROBE_BYTES / best


@dataclass(frozen=True)
class DecodeRoof:
    """What a decode step must read, and how fast this device reads."""

    weight_bytes: float  # every projection weight and the LM head, as stored
    kv_bytes_per_token: int  # one token's keys and values over every layer
    bandwidth_bytes_s: float

    def step_s(self, context_tokens: int) -> float:
        """The least time of a decode step whose rows hold `context_tokens` in all."""
        read = self.weight_bytes + context_tokens * self.kv_bytes_per_token
        return read / self.bandwidth_bytes_s

    @classmethod
    def for_engine(
        cls, spec: ModelSpec, element_size: float, kv_bytes_per_token: int,
        bandwidth_gb_s: float, device: torch.device,
    ) -> DecodeRoof:  # fmt: skip
        """The roof of this engine's steps; `bandwidth_gb_s` 0: measure it now."""
        bandwidth = bandwidth_gb_s * 1e9 if bandwidth_gb_s > 0 else read_bandwidth(device)
        weights = linear_weight_bytes(spec, element_size)
        return cls(weights, kv_bytes_per_token, bandwidth)
