"""The sides of the engine benchmark, each timed on the same requests.

Lifecycle of a phase's side (`bench.run_phase` runs pdserve, pdserve in float32
when the run's dtype is another, transformers static, then transformers continuous):

- pdserve at batch B (`run_pdserve`): a fresh `LLMEngine` with `max_num_seqs=B`, an
  untimed warm-up on other prompts, then every request submitted at once and stepped
  until done (continuous batching keeps B running). It raises if a request got other
  than its requested tokens or the engine kept a block or a request afterwards.
- transformers at batch B (`run_transformers`; the model is loaded once per run by
  `load_hf_model`): consecutive static batches of B requests, left-padded with an
  attention mask, greedy `generate` run to the batch's longest output.
- transformers continuous batching at batch B (`run_transformers_cb`; its own copy of
  the model with the paged SDPA attention): every request added to one
  `ContinuousBatchingManager` at once, at most B scheduled per step, each with its own
  `max_new_tokens` and EOS disabled; the peer `transformers serve --continuous-batching`
  runs on.

All sides compute in the run's dtype.

Both are greedy and ignore EOS, so each request gets exactly its requested tokens.
Throughput = the requests' own requested output tokens / wall seconds, prefill included:
a static batch's padding and over-generation are its honest cost.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.precision import DType
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats
from loadtest.engine.bench_config import EngineBenchConfig
from loadtest.engine.workload import EngineRequest, PhasePlan, warmup_workload
from loadtest.harness.settings import RunSettings

#: SmolLM2's pad id (= its EOS); left padding never reaches a sampled position.
PAD_ID = 2
#: Tokens compared when reporting how often both sides produced the same greedy output.
AGREEMENT_PREFIX = 8
#: How long to wait on transformers' continuous-batching manager for a result.
HF_CB_WAIT_S = 5.0
#: Tokens per page of transformers' paged cache (its default).
HF_CB_PAGE = 256


@dataclass(frozen=True)
class SideResult:
    """One side's timed run of a phase.

    `output_tokens` counts only each request's own requested tokens (the useful ones);
    `computed_tokens` counts every position the model ran, padding and overrun included.
    """

    wall_s: float
    output_tokens: int
    prompt_tokens: int
    computed_tokens: int
    forward_passes: int
    tokens_per_s: float
    total_tokens_per_s: float


def side_result(
    wall_s: float, requests: Sequence[EngineRequest], computed: int, passes: int
) -> SideResult:
    out = sum(r.max_tokens for r in requests)
    prompt = sum(len(r.prompt) for r in requests)
    return SideResult(
        wall_s=wall_s,
        output_tokens=out,
        prompt_tokens=prompt,
        computed_tokens=computed,
        forward_passes=passes,
        tokens_per_s=out / wall_s,
        total_tokens_per_s=(out + prompt) / wall_s,
    )


def agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    """Fraction of requests whose first few greedy tokens match on both sides."""
    same = sum(x[:AGREEMENT_PREFIX] == y[:AGREEMENT_PREFIX] for x, y in zip(a, b, strict=True))
    return same / len(a)


# -- pdserve --------------------------------------------------------------------------
def build_engine(
    settings: RunSettings, cfg: EngineBenchConfig, batch_size: int, dtype: DType
) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_cache_dir=settings.model_cache_dir.expanduser(),
            kv_cache_bytes=cfg.kv_cache_bytes,
            max_num_seqs=batch_size,
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            num_threads=cfg.threads,
            dtype=dtype,
        )
    )


def drive_engine(eng: LLMEngine, requests: Sequence[EngineRequest]) -> tuple[list[list[int]], int]:
    """Submit every request at once and step until all finish; returns outputs and steps."""
    ids = [
        eng.add_request(
            RequestSpec(
                list(r.prompt),
                SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True),
            )
        )
        for r in requests
    ]
    produced: dict[str, list[int]] = {rid: [] for rid in ids}
    steps = 0
    while eng.has_unfinished():
        for out in eng.step():
            produced[out.request_id].extend(out.new_token_ids)
        steps += 1
    return [produced[rid] for rid in ids], steps


def run_pdserve(
    settings: RunSettings,
    cfg: EngineBenchConfig,
    plan: PhasePlan,
    requests: Sequence[EngineRequest],
    vocab_size: int,
    dtype: DType,
) -> tuple[SideResult, list[list[int]], EngineStats]:
    """Time pdserve on the phase; raises if a request got other than its requested tokens."""
    eng = build_engine(settings, cfg, plan.batch_size, dtype)
    if cfg.warmup:
        drive_engine(eng, warmup_workload(min(plan.batch_size, 2), vocab_size, settings.seed))
    start = time.perf_counter()
    outputs, steps = drive_engine(eng, requests)
    wall = time.perf_counter() - start
    stats = eng.stats()
    for r, out in zip(requests, outputs, strict=True):
        if len(out) != r.max_tokens:
            raise RuntimeError(f"pdserve produced {len(out)} tokens, {r.max_tokens} requested")
    if stats.used_blocks or stats.running or stats.waiting:
        raise RuntimeError(f"pdserve left work or blocks behind: {stats}")
    computed = sum(len(r.prompt) + r.max_tokens - 1 for r in requests)
    return side_result(wall, requests, computed, steps), outputs, stats


# -- transformers ---------------------------------------------------------------------
def load_hf_model(model_dir: Path, dtype: torch.dtype, *, paged: bool = False) -> Any:
    """The reference model in pdserve's dtype (transformers is a test extra); `paged`
    loads it with the paged SDPA attention its continuous batching needs."""
    import transformers

    attn = "paged|sdpa" if paged else "sdpa"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attn
    )
    return model.eval()


def hf_static_batch(model: Any, batch: Sequence[EngineRequest]) -> tuple[list[list[int]], int]:
    """Generate one left-padded static batch to its longest output; returns outputs, steps."""
    width = max(len(r.prompt) for r in batch)
    steps = max(r.max_tokens for r in batch)
    ids = torch.tensor([[PAD_ID] * (width - len(r.prompt)) + list(r.prompt) for r in batch])
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in batch])
    with torch.inference_mode():
        # min_new_tokens = max_new_tokens: EOS cannot end a row early, like ignore_eos.
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=steps,
            min_new_tokens=steps,
            do_sample=False,
            pad_token_id=PAD_ID,
        )
    if out.shape[1] != width + steps:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} of {steps} tokens")
    new = out[:, width:].tolist()
    return [row[: r.max_tokens] for row, r in zip(new, batch, strict=True)], steps


def run_transformers(
    settings: RunSettings,
    cfg: EngineBenchConfig,
    model: Any,
    plan: PhasePlan,
    requests: Sequence[EngineRequest],
    vocab_size: int,
) -> tuple[SideResult, list[list[int]]]:
    """Time transformers on the phase in consecutive static batches of `batch_size`."""
    if cfg.warmup:
        warm = warmup_workload(min(plan.batch_size, 2), vocab_size, settings.seed)
        hf_static_batch(model, warm)
    b = plan.batch_size
    batches = [requests[i : i + b] for i in range(0, len(requests), b)]
    outputs: list[list[int]] = []
    computed = passes = 0
    start = time.perf_counter()
    for batch in batches:
        out, steps = hf_static_batch(model, batch)
        outputs.extend(out)
        computed += len(batch) * (max(len(r.prompt) for r in batch) + steps - 1)
        passes += steps
    wall = time.perf_counter() - start
    return side_result(wall, requests, computed, passes), outputs


def hf_cache_blocks(model: Any, kv_cache_bytes: int, page_size: int = HF_CB_PAGE) -> int:
    """Pages of transformers' paged cache that fit pdserve's KV budget in the same run:
    both sides get the same cache memory (left to itself, the manager sizes its cache
    from the host's free memory, and allocating that took 10-25 s per manager here)."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * model.dtype.itemsize
    return max(1, kv_cache_bytes // (page_size * per_token))


def hf_continuous(
    model: Any,
    batch: int,
    step_tokens: int,
    requests: Sequence[EngineRequest],
    kv_cache_bytes: int,
) -> tuple[list[list[int]], float]:
    """Every request through one continuous-batching manager, at most `batch` requests
    and `step_tokens` tokens (pdserve's budget in the same run) per step, with pdserve's
    KV memory. Returns the outputs and the seconds from the first request in to the last
    result out: the manager's start (cache allocation) and stop are not timed, as a
    server started once (`transformers serve --continuous-batching`) pays them once."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    longest = max(r.max_tokens for r in requests)
    # eos_token_id None: the manager disables EOS, so each request runs its own length.
    gen = GenerationConfig(do_sample=False, max_new_tokens=longest, eos_token_id=None,
                           pad_token_id=PAD_ID)  # fmt: skip
    cb = ContinuousBatchingConfig(
        page_size=HF_CB_PAGE, num_blocks=hf_cache_blocks(model, kv_cache_bytes),
        max_requests_per_batch=batch, max_batch_tokens=step_tokens,
    )  # fmt: skip
    done: dict[str, list[int]] = {}
    with model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, block=True, timeout=HF_CB_WAIT_S
    ) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(list(r.prompt), max_new_tokens=r.max_tokens) for r in requests]
        while len(done) < len(ids):
            result = manager.get_result(timeout=HF_CB_WAIT_S)
            if result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching stopped early")
            if result is not None and result.is_finished():
                done[result.request_id] = list(result.generated_tokens)
        wall = time.perf_counter() - start
    return [done[rid] for rid in ids], wall


def run_transformers_cb(
    settings: RunSettings,
    cfg: EngineBenchConfig,
    model: Any,
    plan: PhasePlan,
    requests: Sequence[EngineRequest],
    vocab_size: int,
) -> tuple[SideResult, list[list[int]]]:
    """Time transformers' continuous batching on the phase."""
    if cfg.warmup:
        warm = warmup_workload(2, vocab_size, settings.seed)
        hf_continuous(model, plan.batch_size, cfg.max_num_batched_tokens, warm,
                      cfg.kv_cache_bytes)  # fmt: skip
    outputs, wall = hf_continuous(model, plan.batch_size, cfg.max_num_batched_tokens, requests,
                                  cfg.kv_cache_bytes)  # fmt: skip
    for r, out in zip(requests, outputs, strict=True):
        if len(out) != r.max_tokens:
            raise RuntimeError(f"transformers CB made {len(out)} tokens, {r.max_tokens} asked")
    computed = sum(len(r.prompt) + r.max_tokens - 1 for r in requests)
    return side_result(wall, requests, computed, 0), outputs
