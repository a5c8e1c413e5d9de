"""What an integration module may hold its clusters to instead of the product defaults.

The integration suite runs what `pdserve up` runs: workers computing in their default
dtype (`auto`: bfloat16 on a CPU with native bf16, float32 elsewhere, as on the AVX2-only
hosts development and CI ran on from 2026-12-01), the gateway deciding conditional
disaggregation at its default threshold (which also lets a prefill worker run a short
request whole), and the role planner free to move workers.
A module that cannot hold its assertions on those defaults names the pins it needs with
`pytest.mark.pins(...)` in its `pytestmark`, and says why beside it; the module fixture
in conftest.py sets them (and clears every other) while the module's clusters start.

The reasons a module pins, today:
- `FLOAT32`: it compares tokens or log-probabilities exactly, with HF transformers or
  across two runs, paths or loads. In bfloat16 a request's tokens still depend on what
  else its step runs (issue 42), so those comparisons hold in float32 only.
- `PREFILL_HOP`: it asserts the prefill hop itself (token 1 from a prefill worker, a KV
  import, a transfer span) with prompts short enough that the gateway would otherwise
  prefill them on the decode worker.
- `FIXED_ROLES`: it kills or counts workers by the role they started in, under load long
  enough for the role planner to move one.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import pytest


class Pin(enum.Enum):
    """One environment variable the children read, and the value the pin gives it."""

    FLOAT32 = ("PDSERVE_DTYPE", "float32")
    PREFILL_HOP = ("PDSERVE_LOCAL_PREFILL_MAX_TOKENS", "0")
    FIXED_ROLES = ("PDSERVE_ROLE_WINDOW_S", "0")

    @property
    def env_var(self) -> str:
        return self.value[0]

    @property
    def pinned(self) -> str:
        return self.value[1]


def module_pins(node: pytest.Item | pytest.Collector) -> frozenset[Pin]:
    """The pins a module's `pytest.mark.pins(...)` names (none without the marker)."""
    marker = node.get_closest_marker("pins")
    pins = frozenset(marker.args) if marker else frozenset()
    unknown = [p for p in pins if not isinstance(p, Pin)]
    if unknown:
        raise TypeError(f"pytest.mark.pins takes Pin members, got {unknown!r}")
    return pins


@contextmanager
def product_defaults(pins: Iterable[Pin]) -> Iterator[None]:
    """The environment children inherit while the context is open: each named pin's
    value, and the other pins' variables unset (the product's defaults). The caller's
    environment comes back on exit."""
    pins = frozenset(pins)
    with pytest.MonkeyPatch.context() as env:
        for pin in Pin:
            if pin in pins:
                env.setenv(pin.env_var, pin.pinned)
            else:
                env.delenv(pin.env_var, raising=False)
        yield
