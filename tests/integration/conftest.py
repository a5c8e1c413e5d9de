"""What every integration test's cluster inherits: the product defaults, less the pins
its module names (`pins.py`), and TTFT budgets long enough that admission control never
refuses a test's request on this host.

The gateway's default budgets (critical 10 s, standard 5 s, sheddable 2 s) are for a
serving fleet; here one CPU core prefills the default model at a few hundred tokens per
second, and the fault drills, the fuzzer and the disconnect tests send prompts that take
longer than that. They test faults, input and cleanup, not admission, so their clusters
get 120 s budgets through the env vars the gateway children inherit. The admission tests
set their own (`test_admission.py` through env vars, `test_fairness.py` through gateway
flags, which win over env vars).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine.priority import Priority
from tests.integration.pins import module_pins, product_defaults

TEST_BUDGET_S = "120"


# Per module, not per session: set before each module's cluster starts (autouse runs
# first in its scope), and gone before the unit tests, whose configs read the env too.
@pytest.fixture(scope="module", autouse=True)
def generous_ttft_budgets() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as env:
        for p in Priority:
            env.setenv(f"PDSERVE_TTFT_BUDGET_{p.name}_S", TEST_BUDGET_S)
        yield


# Autouse in module scope, like the budgets: set before the module's clusters start, and
# gone before the next module (the unit tests keep tests/conftest.py's pins).
@pytest.fixture(scope="module", autouse=True)
def defaults_less_pins(request: pytest.FixtureRequest) -> Iterator[None]:
    with product_defaults(module_pins(request.node)):
        yield
