"""The integration suite's pins (tests/integration/pins.py): a module without the marker
starts its children on the product defaults, one with it keeps exactly the pins it names,
and the caller's environment comes back afterwards."""

from __future__ import annotations

import os

import pytest

from tests.integration.pins import Pin, module_pins, product_defaults


@pytest.fixture
def suite_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # What tests/conftest.py leaves for every test process: each pin set.
    for pin in Pin:
        monkeypatch.setenv(pin.env_var, pin.pinned)


@pytest.mark.usefixtures("suite_env")
def test_no_pins_is_the_product_defaults() -> None:
    with product_defaults(()):
        assert not any(pin.env_var in os.environ for pin in Pin)
    # Back to the suite's pins once the module is done.
    assert all(os.environ[pin.env_var] == pin.pinned for pin in Pin)


@pytest.mark.usefixtures("suite_env")
def test_named_pins_are_kept_and_the_others_cleared() -> None:
    with product_defaults({Pin.FLOAT32, Pin.FIXED_ROLES}):
        assert os.environ[Pin.FLOAT32.env_var] == "float32"
        assert os.environ[Pin.FIXED_ROLES.env_var] == "0"
        assert Pin.PREFILL_HOP.env_var not in os.environ


def test_a_module_marker_names_its_pins() -> None:
    class Node:
        def __init__(self, marker: pytest.Mark | None) -> None:
            self.marker = marker

        def get_closest_marker(self, name: str) -> pytest.Mark | None:
            return self.marker if name == "pins" else None

    marked = pytest.mark.pins(Pin.PREFILL_HOP, Pin.FLOAT32).mark
    assert module_pins(Node(marked)) == {Pin.PREFILL_HOP, Pin.FLOAT32}  # type: ignore[arg-type]
    assert module_pins(Node(None)) == frozenset()  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Pin members"):
        module_pins(Node(pytest.mark.pins("PDSERVE_DTYPE").mark))  # type: ignore[arg-type]
