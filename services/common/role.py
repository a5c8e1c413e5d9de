"""What a worker does in the cluster: the one place the role names are defined.

A worker's role is fixed for its life: it is chosen by its config, registered with the
router under it, and decides which of the Prefill and Decode RPCs it serves. `Role` is a
`StrEnum`, so its values are the names on the wire (Redis keys, flags, proto strings).
"""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """A worker pool: prefill only, decode only, or both in one engine (colocated)."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"

    @classmethod
    def parse(cls, text: str) -> Role:
        """The role named `text`; ValueError naming the allowed values otherwise."""
        try:
            return cls(text)
        except ValueError:
            allowed = ", ".join(r.value for r in cls)
            raise ValueError(f"role must be one of {allowed}, got {text!r}") from None

    @classmethod
    def is_role(cls, text: str) -> bool:
        """Whether `text` names a role (parsing untrusted keys without raising)."""
        return text in cls._value2member_map_
