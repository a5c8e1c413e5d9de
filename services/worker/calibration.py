"""The worker's first prefill: measured before it registers, so no gateway admits blind.

A gateway estimates a request's TTFT from the workers' published prefill speed
(`WorkerSignal.prefill_tokens_per_s`, measured by the engine while busy). A worker that
has never prefilled has no speed, and the gateway then lets a fixed number of requests
through per replica (`admission.UNMEASURED_PENDING`): with several gateway replicas
and a cold pool, that first burst queued many seconds of work, past every TTFT budget,
and the cluster-wide fair share started from a ledger the burst had already skewed
(measured: docs/history.md, "The blind first burst").

`calibrate(engine)` runs two synthetic prompts through the engine, one output token
each, before the engine loop starts: a short one that pays the engine's one-time costs
(first kernels, on a GPU the context and its libraries), then one of
`CALIBRATION_PROMPT_TOKENS` that is measured. It returns the engine's stats between the
two (`Calibration.baseline`); the signal publisher counts from there, so the worker's
first published signal carries the measured prefill's speed and not the cold one's. It
is one prompt's speed: real prompts of other lengths run faster or slower, and the
publisher's busy-time average moves to theirs with a time constant of
`SPEED_HORIZON_S` busy seconds.

Calibration only informs admission: where it cannot run (a KV pool or a context too
small for even a short prompt) or fails, the worker logs a warning and starts without
it, and the gateways fall back to admitting a few requests at a time until it has
measured a real prefill.

The requests are the engine's own (no gateway, no tenant): they show in the worker's
token counters, and their KV blocks stay in the prefix cache as evictable blocks that
no real prompt matches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

log = logging.getLogger(__name__)

CALIBRATION_PROMPT_TOKENS = 128
WARM_UP_PROMPT_TOKENS = 16
# Token ids of the synthetic prompts start here: past the special tokens at the start of
# every tokenizer's vocabulary (whose meaning a model may special-case).
FIRST_TOKEN_ID = 1000


@dataclass(frozen=True)
class Calibration:
    baseline: EngineStats  # the engine's stats after the warm-up, before the measured one
    tokens_per_s: float  # the measured prefill's speed


def calibration_prompt(vocab_size: int, length: int, offset: int = 0) -> list[int]:
    """`length` distinct ordinary token ids (fewer only where the vocabulary is smaller),
    starting `offset` ids past `FIRST_TOKEN_ID`, so two prompts share no block."""
    first = FIRST_TOKEN_ID if vocab_size > FIRST_TOKEN_ID + offset + length else 0
    span = max(1, vocab_size - first)
    return [first + (offset + i) % span for i in range(length)]


def prompt_room(engine: LLMEngine) -> int:
    """The longest prompt the engine takes with one output token: its context and its
    whole KV pool bound it."""
    capacity = engine.pool.num_blocks * engine.config.block_size
    return min(engine.max_model_len, capacity) - 1


def calibrate(engine: LLMEngine) -> Calibration | None:
    """Warm up, then prefill the measured prompt; None (logged) where it cannot run.
    Call before the engine loop starts (it steps the engine on the calling thread)."""
    room = prompt_room(engine)
    length = min(CALIBRATION_PROMPT_TOKENS, room)
    if length < 1:
        log.warning("no calibration: the engine takes no prompt (context or KV pool too small)")
        return None
    vocab, one_token = engine.spec.vocab_size, SamplingParams(max_tokens=1, temperature=0.0)
    try:
        engine.generate([calibration_prompt(vocab, min(WARM_UP_PROMPT_TOKENS, length))], one_token)
        baseline = engine.stats()
        started = time.perf_counter()
        engine.generate([calibration_prompt(vocab, length, WARM_UP_PROMPT_TOKENS)], one_token)
    except Exception:  # calibration is an estimate's seed: never a reason not to serve
        log.warning("calibration failed; the worker starts without a measured speed",
                    exc_info=True)  # fmt: skip
        return None
    after = engine.stats()
    busy = after.prefill_busy_s_total - baseline.prefill_busy_s_total
    tokens = after.prefill_tokens_total - baseline.prefill_tokens_total
    speed = tokens / busy if busy > 0 else 0.0
    log.info("calibrated: %d prompt tokens in %.3f s (%.0f tokens/s)",
             tokens, time.perf_counter() - started, speed)  # fmt: skip
    return Calibration(baseline, speed)
