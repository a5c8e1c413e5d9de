from __future__ import annotations

import pytest

from services.router.release_backlog import ReleaseBacklog


def test_take_returns_everything_oldest_first_and_empties() -> None:
    backlog = ReleaseBacklog()
    backlog.add(["a", "b"])
    backlog.add(["c"])
    assert len(backlog) == 3
    assert backlog.take() == ["a", "b", "c"]
    assert len(backlog) == 0 and backlog.take() == []


def test_past_the_limit_the_oldest_go_first() -> None:
    backlog = ReleaseBacklog(limit=3)
    backlog.add(["a", "b", "c", "d"])
    backlog.add(["e"])
    assert backlog.take() == ["c", "d", "e"]


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="limit must be >= 1, got 0"):
        ReleaseBacklog(limit=0)
