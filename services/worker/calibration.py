"""The worker's first prefill: measured before it registers, so no gateway admits blind.

A gateway estimates a request's TTFT from the workers' published prefill speed
(`WorkerSignal.prefill_tokens_per_s`, measured by the engine while busy). A worker that
has never prefilled has no speed, and the gateway then lets a fixed number of requests
through per replica (`admission.UNMEASURED_PENDING`): with several gateway replicas
and a cold pool, that first burst queued many seconds of work, past every TTFT budget,
and the cluster-wide fair share started from a ledger the burst had already skewed
(measured: docs/history.md, "The blind first burst").

`calibrate(engine)` runs one synthetic prompt of `CALIBRATION_PROMPT_TOKENS` through
the engine, with one output token, before the engine loop starts. The engine's step
counters then hold that prefill, and the signal publisher's first speed sample is
taken from them, so the worker's first published signal already carries a speed. The
prompt is short (a fraction of a second on two CPU cores), and a short prompt computes
fewer tokens per second than a long one: the first estimate errs on the slow side,
and the first real prefills replace it within `SPEED_HORIZON_S` busy seconds.

The request is the engine's own (no gateway, no tenant): it shows in the worker's token
counters as one request, and its KV blocks stay in the prefix cache as evictable
blocks that no real prompt matches.
"""

from __future__ import annotations

import logging
import time

from engine.engine import LLMEngine
from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

CALIBRATION_PROMPT_TOKENS = 128
# Token ids of the synthetic prompt start here: past the special tokens at the start of
# every tokenizer's vocabulary (whose meaning a model may special-case).
FIRST_TOKEN_ID = 1000


def calibration_prompt(vocab_size: int, max_model_len: int) -> list[int]:
    """The synthetic prompt: distinct ordinary token ids, leaving room for one output."""
    length = max(1, min(CALIBRATION_PROMPT_TOKENS, max_model_len - 1))
    first = FIRST_TOKEN_ID if vocab_size > FIRST_TOKEN_ID + length else 0
    return [first + i % max(1, vocab_size - first) for i in range(length)]


def calibrate(engine: LLMEngine) -> float:
    """Prefill the synthetic prompt; its speed in tokens per second. Call before the
    engine loop starts (it steps the engine on the calling thread)."""
    prompt = calibration_prompt(engine.spec.vocab_size, engine.max_model_len)
    before = engine.stats()
    started = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    after = engine.stats()
    busy = after.prefill_busy_s_total - before.prefill_busy_s_total
    tokens = after.prefill_tokens_total - before.prefill_tokens_total
    speed = tokens / busy if busy > 0 else 0.0
    log.info("calibrated: %d prompt tokens in %.3f s (%.0f tokens/s)",
             tokens, time.perf_counter() - started, speed)  # fmt: skip
    return speed
