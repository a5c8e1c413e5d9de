"""The overload benchmark's own knobs, on top of the shared flow-control ones
(`loadtest.flow.config`): how far past capacity, for how long, and the class mix."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from engine.priority import Priority
from loadtest.flow.config import FlowBenchConfig

MIX_ORDER = (Priority.CRITICAL, Priority.STANDARD, Priority.SHEDDABLE)


def parse_mix(text: str) -> dict[Priority, float]:
    """'0.2,0.5,0.3' -> shares of critical, standard, sheddable (normalised to sum 1).
    A class may have share 0 (it sends nothing), as long as one has more."""
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(f"class_mix must be 3 numbers, got {text!r}") from None
    if len(values) != 3 or min(values) < 0 or sum(values) <= 0:
        raise ValueError(f"class_mix must be 3 shares >= 0 (critical,standard,sheddable), "
                         f"summing to > 0, got {text!r}")  # fmt: skip
    total = sum(values)
    return {p: v / total for p, v in zip(MIX_ORDER, values, strict=True) if v > 0}


@dataclass(frozen=True)
class OverloadBenchConfig(FlowBenchConfig):
    duration_s: float = field(
        default=120.0, metadata={"help": "seconds of overload traffic (the measured run)"}
    )
    overload_factor: float = field(
        default=3.0, metadata={"help": "offered load during the run, in multiples of capacity"}
    )
    class_mix: str = field(
        default="0.2,0.5,0.3",
        metadata={"help": "shares of critical,standard,sheddable requests (capacity and run)"},
    )
    critical_attainment_target: float = field(
        default=0.95, metadata={"help": "target: critical attainment under overload"}
    )
    goodput_ratio_target: float = field(
        default=0.9, metadata={"help": "target: goodput under overload / goodput at capacity"}
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        parse_mix(self.class_mix)
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be > 0, got {self.duration_s}")
        if self.overload_factor < 1:
            raise ValueError(f"overload_factor must be >= 1, got {self.overload_factor}")
        if not 0 < self.critical_attainment_target <= 1 or self.goodput_ratio_target <= 0:
            raise ValueError("critical_attainment_target in (0, 1], goodput_ratio_target > 0")

    @property
    def mix(self) -> Mapping[Priority, float]:
        return parse_mix(self.class_mix)
