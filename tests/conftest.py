"""Shared fixtures: the real default model, prepared once per machine, and engines on it."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from engine.config import DEFAULT_MODEL_CACHE, EngineConfig
from engine.draft_model import DraftModel
from engine.engine import LLMEngine
from engine.model_store import prepare_default_model
from tests.integration.pins import Pin

MODEL_CACHE = DEFAULT_MODEL_CACHE.expanduser()

# The unit tests compute in float32 unless a test asks otherwise: many hold outputs
# token-exact across batch shapes, paths and HF transformers, which float32 keeps and
# bf16's rounding does not (near-ties flip; issue 42). `make_engine` pins it too. bf16
# and int8 are held to float32 by the accuracy gate (test_accuracy_gate.py), and by tests
# that set them explicitly. The unit tests' in-process gateways also take the prefill hop
# for every prompt and their workers keep their roles, unless a test turns those on
# itself (the unit tests of `prefill_site` and the role planner).
# The integration modules run the product defaults instead (bf16, conditional
# disaggregation, roles that move), each less the pins it names and says why
# (tests/integration/pins.py); these setdefaults are what they start from.
for _pin in Pin:
    os.environ.setdefault(_pin.env_var, _pin.pinned)
# Under pytest-xdist (`make test` runs the unit tests on one process per core) each
# process computes on one thread, so the processes do not oversubscribe the cores.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int | None:
    """`-n auto`: one process per core this process may run on (xdist's own count asks
    psutil for the machine's cores, which in a container can be the whole host's).
    xdist's PYTEST_XDIST_AUTO_NUM_WORKERS still wins (None defers to xdist)."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") or not hasattr(os, "sched_getaffinity"):
        return None
    return len(os.sched_getaffinity(0))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Everything outside tests/unit runs in `make test`'s serial phase (an integration
    # test starts a cluster of several processes, and some hold deadlines or fair
    # shares), except the files marked pairable, which run two at a time before it.
    unit = Path(__file__).parent / "unit"
    for item in items:
        if unit not in item.path.parents and "pairable" not in item.keywords:
            item.add_marker(pytest.mark.serial)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return prepare_default_model(MODEL_CACHE, progress=False)


EngineFactory = Callable[..., LLMEngine]


@pytest.fixture(scope="session")
def make_engine(model_dir: Path) -> Iterator[EngineFactory]:
    """Build engines on the default model; every keyword goes to EngineConfig."""

    def build(**overrides: object) -> LLMEngine:
        settings: dict[str, object] = {
            "model": str(model_dir),
            "kv_cache_bytes": 64 << 20,
            "dtype": "float32",
        }
        settings.update(overrides)
        return LLMEngine(EngineConfig(**settings))  # type: ignore[arg-type]

    yield build


def assert_no_leaks(engine: LLMEngine) -> None:
    """Every block back in the pool, no request left anywhere, no offload slot lost."""
    s = engine.stats()
    assert s.used_blocks == 0, s
    if engine.offload is not None:
        tier = engine.offload.stats()
        assert tier.reserved == 0 and tier.kept == 0, tier  # nor a preempted one's hashes
    assert s.running == s.waiting == s.held_requests == s.importing_requests == 0, s
    assert not engine.requests
    assert not engine.has_unfinished()
    assert not engine.speculator.states  # no ended request's draft state left
    assert not engine.loras.held()  # no ended request still holds its LoRA adapter
    draft = engine.speculator.draft
    if isinstance(draft, DraftModel):  # nor a draft model's shadow or block
        assert not draft.shadows and draft.pool.stats().used == 0
