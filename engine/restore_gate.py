"""Copy a block back from the offload tier, or compute it again: the choice, measured.

Lifecycle: the engine makes one `RestoreGate` when it has an offload tier and gives the
scheduler its `pays` to ask before each block it would restore (a prefix hit past the
pool's blocks, or a preempted request's own blocks on resume). Under `--kv-restore
faster` the answer compares two costs this engine measured since it started:
- a restore: the tier's wall time of its copies per block (`OffloadStats.restore_s`);
- a recompute: the wall time of steps that ran a prefill chunk per prefill token, times
  the block size (`StepMeter`).
Either unmeasured yet: restore (the first copies measure it). The prefill side counts
whole steps, decodes included, so it overstates a token's cost; the bias is toward
copying, the cheaper mistake (a copy is bounded by the block's bytes, a recompute by
the model). On a CPU the copy is a memcpy, orders of magnitude below a block's prefill;
on a GPU the copy crosses PCIe while a small model's prefill may not, and there
recomputing can win. `always` and `never` fix the answer (preemption by swap or by
recompute), for benchmarks and for operators who measured otherwise.
"""

from __future__ import annotations

from engine.config import KvRestore
from engine.kv_offload import OffloadTier
from engine.step_meter import StepMeter


class RestoreGate:
    """Whether restoring a block from the tier is worth it now. Called on the step thread."""

    def __init__(
        self, policy: KvRestore, tier: OffloadTier, meter: StepMeter, block_size: int
    ) -> None:
        self.policy = policy
        self._tier = tier
        self._meter = meter
        self._block_size = block_size

    def pays(self) -> bool:
        if self.policy is not KvRestore.FASTER:
            return self.policy is KvRestore.ALWAYS
        copy_s, recompute_s = self.costs()
        return copy_s is None or recompute_s is None or copy_s <= recompute_s

    def costs(self) -> tuple[float | None, float | None]:
        """(seconds to restore a block, seconds to recompute one); None: not measured."""
        copy_s = self._tier.restore_s_per_block()
        meter = self._meter
        recompute_s = (
            meter.prefill_busy_s / meter.prefill_tokens * self._block_size
            if meter.prefill_tokens
            else None
        )
        return copy_s, recompute_s
