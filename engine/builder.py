"""Building an engine's parts from its config: model, KV pool, scheduler, adapters, kernels.

Lifecycle: `build_parts(config)` runs once, at `LLMEngine` construction. It resolves the
model (converting the default one on first use), loads the weights in the compute dtype
with the linear kernel picked for it (and the fused decode where it runs), sizes the KV
pool from its memory budget, and makes the scheduler, the adapters of `--lora-dir`, the
optional offload tier, the attention backend, the model runner, the stop rules and the
speculator (with its draft model, when one is named). Each choice is logged. The parts
hold only memory: nothing here needs closing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import select_backend
from engine.block_pool import BlockPool
from engine.config import DecodeKernel, EngineConfig, SpecMode
from engine.draft_model import DraftModel
from engine.fused_decode import fused_decode_wanted
from engine.invariance import InvariantChoice, invariant_kernel
from engine.kv_cache import KvCache
from engine.kv_layout import QMAX, KvLayout, blocks_for_budget, kernel_family
from engine.kv_offload import OffloadTier
from engine.linear_kernel import pick_linear_kernel
from engine.llama import LlamaModel
from engine.lora import LoraTarget
from engine.lora_set import LoraSet
from engine.model_runner import ModelRunner
from engine.model_spec import ModelSpec
from engine.model_store import resolve_model_dir
from engine.precision import kv_storage_dtype
from engine.residency import ResidencyLog
from engine.scheduler import Scheduler, SchedulerConfig
from engine.speculation import Speculator
from engine.stop_checker import StopChecker
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelParts:
    """The model and what describes it."""

    model_dir: Path
    spec: ModelSpec
    tokenizer: Tokenizer
    model: LlamaModel
    max_model_len: int


@dataclass(frozen=True)
class EngineParts:
    """Everything an engine steps with, built from one config."""

    models: ModelParts
    layout: KvLayout
    kv_cache: KvCache
    pool: BlockPool
    scheduler: Scheduler
    loras: LoraSet
    offload: OffloadTier | None
    residency: ResidencyLog
    runner: ModelRunner
    stop_checker: StopChecker
    eos_ids: frozenset[int]
    speculator: Speculator


def build_parts(config: EngineConfig, *, progress: bool = False) -> EngineParts:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    invariance = invariant_kernel(config)
    models = _model(config, invariance, progress)
    kv_dtype = kv_storage_dtype(config.kv_cache_dtype, config.torch_dtype)
    backend = select_backend(
        config.attention_backend, config.torch_device, config.torch_dtype,
        quantized_kv=kv_dtype in QMAX,
        # Where the fused decode runs, larger decode steps use its attention too.
        compiled_decode=models.model.fused is not None,
        invariant=invariance.invariant,
    )  # fmt: skip
    fused = models.model.fused
    layout = KvLayout.from_spec(
        models.spec, kv_dtype, config.block_size, config.torch_device,
        compute_dtype=config.torch_dtype,
        kernels=kernel_family(
            models.model.kernel.name, fused.max_rows if fused else 0, backend.name
        ),
    )  # fmt: skip
    num_blocks = config.num_kv_blocks or blocks_for_budget(layout, config.kv_cache_bytes)
    kv_cache = KvCache(layout, num_blocks, config.torch_device)
    pool = BlockPool(num_blocks)
    residency = ResidencyLog()
    pool.residency = residency
    scheduler = Scheduler(
        SchedulerConfig(config.block_size, config.max_num_seqs, config.max_num_batched_tokens),
        pool,
    )
    offload = None
    if config.kv_offload_bytes:
        offload = OffloadTier(kv_cache, config.kv_offload_bytes)
        pool.on_evict = offload.spill
        offload.residency = residency
        scheduler.tier = offload
    eos = set(models.spec.eos_token_ids)
    if models.tokenizer.eos_token_id is not None:
        eos.add(models.tokenizer.eos_token_id)
    parts = EngineParts(
        models=models, layout=layout, kv_cache=kv_cache, pool=pool, scheduler=scheduler,
        loras=_lora_set(config, models.spec, models.model), offload=offload, residency=residency,
        runner=ModelRunner(models.model, kv_cache, backend, config.block_size),
        stop_checker=StopChecker(models.tokenizer, eos, models.max_model_len),
        eos_ids=frozenset(eos),
        speculator=Speculator(
            config.spec_config, _draft_model(config, invariance, models.tokenizer)
        ),
    )  # fmt: skip
    _log_pool(config, parts)
    return parts


def _model(config: EngineConfig, invariance: InvariantChoice, progress: bool) -> ModelParts:
    """The model of `config`, its weights loaded with the kernels chosen for them."""
    model_dir = resolve_model_dir(
        config.model, config.model_cache_dir.expanduser(), progress=progress
    )
    quant = config.quantization
    spec = ModelSpec.from_dir(model_dir).with_weights(quant.value)
    device, dtype = config.torch_device, config.torch_dtype
    kernel = pick_linear_kernel(invariance.linear_kernel, device, dtype, quant)
    log.info("linear layers: %s kernel (%s, %s, weights %s)", kernel.name, device, dtype, quant)
    kv_dtype = kv_storage_dtype(config.kv_cache_dtype, dtype)
    fused = fused_decode_wanted(config.decode_kernel, device, dtype, quant, kv_dtype)
    model = LlamaModel(spec, dtype, device, kernel, fused_kv=kv_dtype if fused else None)
    model.load_weights(model_dir, progress=progress)
    if config.decode_kernel is DecodeKernel.FUSED and model.fused is None:
        raise RuntimeError("decode_kernel fused: its kernel failed to compile (see above)")
    if model.fused is not None:
        log.info("decode-only steps of 1-%d sequences: fused kernel", model.fused.max_rows)
    else:
        log.info("decode: torch forward")
    max_model_len = min(
        config.max_model_len or spec.max_position_embeddings, spec.max_position_embeddings
    )
    return ModelParts(model_dir, spec, Tokenizer(model_dir), model, max_model_len)


def _draft_model(
    config: EngineConfig, invariance: InvariantChoice, tokenizer: Tokenizer
) -> DraftModel | None:
    """The draft model speculation asks, when one is named and speculation is on."""
    if config.spec_draft_model is None or config.speculative_decoding is SpecMode.OFF:
        return None
    cache = config.model_cache_dir.expanduser()
    return DraftModel(
        resolve_model_dir(config.spec_draft_model, cache, progress=False),
        tokenizer, dtype=config.torch_dtype, device=config.torch_device,
        block_size=config.block_size, kv_cache_bytes=config.spec_draft_kv_cache_bytes,
        invariance=invariance,
    )  # fmt: skip


def _lora_set(config: EngineConfig, spec: ModelSpec, model: LlamaModel) -> LoraSet:
    """The adapters of `--lora-dir`, read onto this model's projections."""
    target = LoraTarget(
        spec, config.torch_dtype, config.torch_device, config.max_lora_rank,
        dict(model.folded_gains),
    )  # fmt: skip
    directory = None if config.lora_dir is None else Path(config.lora_dir).expanduser()
    return LoraSet(directory, config.max_loras, target)


def _log_pool(config: EngineConfig, parts: EngineParts) -> None:
    layout, num_blocks = parts.layout, parts.pool.num_blocks
    log.info(
        "KV pool: %d blocks x %d tokens = %d tokens, %.1f MiB (%d bytes/token), model %s",
        num_blocks,
        config.block_size,
        num_blocks * config.block_size,
        num_blocks * layout.bytes_per_block / 2**20,
        layout.bytes_per_token,
        parts.models.model_dir,
    )
