"""What a worker does in the cluster: the one place the role names are defined.

A worker's home role is chosen by its config and registered with the router: it is the
pool the routers find the worker in, so where its work comes from. It can change at run
time (`services/worker/home_role.py`); what the worker can run only grows with it (every
role decodes, `services/worker/phases.py`). `Role` is a `StrEnum`, so its values are the
names on the wire (Redis keys, flags, proto strings).
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
