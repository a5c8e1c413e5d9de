"""Per-request sampling settings, validated once when the request is built."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

#: Stop strings are matched on decoded text; longer ones would make every step slow.
MAX_STOP_STRING_CHARS = 256
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens and when it stops.

    temperature 0 means greedy. top_k 0 disables top-k. `seed` makes a request's samples
    reproducible whatever else shares its batch: each request owns its generator.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise InvalidRequestError("max_tokens", "must be an integer", self.max_tokens)
        if self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens", "must be > 0", self.max_tokens)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", "must be >= 0 and finite", self.temperature)
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidRequestError("top_p", "must be in (0, 1]", self.top_p)
        if self.top_k < 0:
            raise InvalidRequestError("top_k", "must be >= 0 (0 disables it)", self.top_k)
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError("seed", "must be in [0, 2**63)", self.seed)
        self._check_stops()

    def _check_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError("stop", f"at most {MAX_STOP_STRINGS} stop strings")
        for s in self.stop:
            if not s or len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidRequestError(
                    "stop", f"each stop string must have 1 to {MAX_STOP_STRING_CHARS} characters", s
                )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
