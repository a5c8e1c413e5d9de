"""Priority classes: which requests keep their place when capacity runs short.

A request's class is fixed for its life. The gateway takes it from the request (up to
what the caller's API key allows) or the key's default; it travels to the workers in the
request protos, and the engine's scheduler admits higher classes first and preempts the
lowest class first. The values order the classes: a larger value is more important.
"""

from __future__ import annotations

import enum


class Priority(enum.IntEnum):
    """The three classes, lowest first.

    SHEDDABLE   batch and best-effort work: refused or preempted first under pressure
    STANDARD    interactive traffic with a normal TTFT budget (the default)
    CRITICAL    the paying tier's floor: never refused while a lower class holds a place
    """

    SHEDDABLE = 0
    STANDARD = 1
    CRITICAL = 2

    @classmethod
    def parse(cls, name: str, field: str = "priority") -> Priority:
        """The class called `name` (case-insensitive); ValueError naming `field` and the
        allowed names otherwise."""
        try:
            return cls[name.strip().upper()]
        except KeyError:
            allowed = ", ".join(p.name.lower() for p in cls)
            raise ValueError(f"{field} must be one of {allowed}, got {name!r}") from None

    @property
    def label(self) -> str:
        """The class's name as users write it (flags, headers, metrics labels)."""
        return self.name.lower()
