"""The engine's load statistics on a tiny real model: the prefill still owed by class
(waiting and still-prefilling requests, never a hand-off state), and the cumulative
work counters a caller turns into throughput. Every test ends with a leak check."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from engine.priority import Priority
from engine.request_spec import RequestSpec
from engine.sampling_params import SamplingParams
from engine.stats import ClassCounts
from tests.conftest import assert_no_leaks
from tests.tiny_models import VOCAB_SIZE, write_tiny_model

BUDGET = 32  # max_num_batched_tokens: a 40-token prompt takes two steps
BLOCK = 16  # EngineConfig's default block_size
MAX_TOKENS = 3
PARAMS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> LLMEngine:
    model_dir: Path = tmp_path_factory.mktemp("tiny") / "qwen2"
    write_tiny_model("qwen2", model_dir)
    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        num_kv_blocks=64,
        max_num_batched_tokens=BUDGET,
    )
    return LLMEngine(config)


def _prompt(seed: int, length: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, VOCAB_SIZE, (length,), generator=gen).tolist()


def _drain(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def test_waiting_tokens_count_what_is_left_to_prefill_by_class(engine: LLMEngine) -> None:
    engine.add_request(RequestSpec(_prompt(1, 40), PARAMS, priority=Priority.CRITICAL))
    engine.add_request(RequestSpec(_prompt(2, 20), PARAMS, priority=Priority.STANDARD))
    engine.add_request(RequestSpec(_prompt(3, 30), PARAMS, priority=Priority.SHEDDABLE))
    # Queued, not yet in the scheduler: they count already (a gateway must see them).
    assert engine.stats().waiting_tokens_by_class == ClassCounts(30, 20, 40)
    before = engine.stats()
    engine.step()  # the critical prompt is admitted first and takes the whole budget
    s = engine.stats()
    assert (s.running, s.waiting) == (1, 2)
    assert s.waiting_tokens_by_class == ClassCounts(sheddable=30, standard=20, critical=8)
    assert s.prefill_tokens_total - before.prefill_tokens_total == BUDGET
    _drain(engine)
    after = engine.stats()
    assert after.waiting_tokens_by_class == ClassCounts()
    assert after.prefill_tokens_total - before.prefill_tokens_total == 40 + 20 + 30
    assert after.decode_tokens_total - before.decode_tokens_total == 3 * MAX_TOKENS
    assert_no_leaks(engine)


def test_prefill_total_skips_prefix_cache_hits(engine: LLMEngine) -> None:
    prompt = _prompt(4, 40)
    start = engine.stats()
    engine.generate([prompt], PARAMS)
    first = engine.stats()
    assert first.prefill_tokens_total - start.prefill_tokens_total == 40
    engine.generate([prompt], PARAMS)  # its two full blocks are cached now
    second = engine.stats()
    assert second.prefill_tokens_total - first.prefill_tokens_total == 40 - 2 * BLOCK
    assert second.decode_tokens_total - first.decode_tokens_total == MAX_TOKENS
    assert_no_leaks(engine)


def test_busy_time_and_decode_steps_accumulate(engine: LLMEngine) -> None:
    start = engine.stats()
    engine.generate([_prompt(5, 24)], SamplingParams(max_tokens=6, ignore_eos=True))
    s = engine.stats()
    # One step prefills and samples token 1; each of the other five decodes one token.
    assert s.decode_steps_total - start.decode_steps_total == 5
    busy = s.busy_s_total - start.busy_s_total
    prefill_busy = s.prefill_busy_s_total - start.prefill_busy_s_total
    decode_busy = s.decode_busy_s_total - start.decode_busy_s_total
    assert busy > 0 and prefill_busy > 0 and decode_busy > 0
    assert prefill_busy + decode_busy == pytest.approx(busy)  # no step did both here
    idle = engine.stats()
    engine.step()  # nothing to do: no busy time
    assert engine.stats().busy_s_total == idle.busy_s_total
    assert_no_leaks(engine)


def test_hand_off_states_owe_no_prefill(engine: LLMEngine) -> None:
    prompt = _prompt(6, 40)
    engine.handoff.reserve_import(
        RequestSpec(prompt, PARAMS, request_id="imp", priority=Priority.CRITICAL), 7
    )
    assert engine.stats().waiting_tokens_by_class == ClassCounts()  # its KV is landing
    assert engine.handoff.commit_import("imp") is None
    s = engine.stats()
    assert s.waiting == 1 and s.waiting_tokens_by_class == ClassCounts()  # it only decodes
    before = s.prefill_tokens_total
    engine.add_request(RequestSpec(_prompt(8, 20), PARAMS, request_id="held"), hold_kv=True)
    _drain(engine)
    s = engine.stats()
    assert s.held_requests == 1 and s.waiting_tokens_by_class == ClassCounts()
    assert s.prefill_tokens_total - before == 20  # the import computed none of its prompt
    assert engine.handoff.release_held("held")
    engine.step()
    assert_no_leaks(engine)
