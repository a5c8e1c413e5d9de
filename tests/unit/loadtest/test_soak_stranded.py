"""The soak's stranded-resource rate (what the leak probe found, per 1,000 aborts) and
its targets with the crash drill's."""

from __future__ import annotations

import pytest

from loadtest.reliability.crash_drill import CrashDrill, CrashDrillConfig
from loadtest.reliability.leak_probe import Leaks
from loadtest.reliability.soak import SoakReport, Stranded, soak_targets


def _leaks(**fields: object) -> Leaks:
    base: dict[str, object] = {"workers": {}, "load": {}, "expired_kv": {},
                               "expired_load": {}, "gateway": {}, "quota": {}}  # fmt: skip
    base.update(fields)
    return Leaks(**base)  # type: ignore[arg-type]


def test_what_is_held_or_expired_counts_per_thousand_aborts() -> None:
    leaks = _leaks(
        workers={"prefill-0": {"used_blocks": 3, "active_leases": 1}, "decode-0": {"running": 1}},
        load={"decode": 2},
        expired_kv={"prefill-0": 1},
        expired_load={"prefill": 1},
    )
    stranded = Stranded.of(leaks, aborted=200)
    assert (stranded.kv_blocks, stranded.kv_leases, stranded.load_leases) == (3, 2, 3)
    assert stranded.per_1000_aborted() == {"kv_blocks": 15.0, "kv_leases": 10.0,
                                           "load_leases": 15.0}  # fmt: skip


def test_a_clean_cluster_strands_nothing_even_without_aborts() -> None:
    assert set(Stranded.of(_leaks(), aborted=0).per_1000_aborted().values()) == {0.0}
    assert set(Stranded.of(_leaks(), aborted=50).per_1000_aborted().values()) == {0.0}


def test_drill_config_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="warm_s > 0"):
        CrashDrillConfig(warm_s=0)


def _drill(returned_s: float | None) -> CrashDrill:
    return CrashDrill("decode-0", 12, {"ok": 8, "UNAVAILABLE": 4}, 0.5, returned_s, 35.0,
                      30.0, 0, _leaks())  # fmt: skip


def _report(stranded: Stranded) -> SoakReport:
    return SoakReport(100, 1.0, {"ok": 90, "cancelled": 10}, [], _leaks(), 0, {}, {},
                      stranded=stranded)  # fmt: skip


def test_targets_hold_each_rate_to_zero_and_the_crash_to_the_lease_ttl() -> None:
    targets = soak_targets(_report(Stranded(10, 0, 0, 0)), _drill(1.5))
    assert [t.met for t in targets] == [True] * 4
    assert targets[-1].measured == 1.5 and targets[-1].threshold == 30.0
    leaky = soak_targets(_report(Stranded(10, 0, 1, 0)), _drill(None))
    assert [t.met for t in leaky] == [True, False, True, False]
    assert leaky[1].measured == 100.0  # one lease per 10 aborts
    assert leaky[-1].measured == 35.0  # never back: the drill's whole bound


def test_refusals_by_admission_are_expected_up_to_a_share() -> None:
    """Refused requests hold nothing (the leak probe checks): a few pass; a soak that
    mostly refused did not soak the served path, and fails."""
    some = SoakReport(100, 1.0, {"ok": 85, "cancelled": 10, "refused": 5}, [], _leaks(), 0,
                      {}, {})  # fmt: skip
    assert some.passed and some.to_json()["unexpected_errors"] == 0
    most = SoakReport(100, 1.0, {"ok": 60, "cancelled": 10, "refused": 30}, [], _leaks(), 0,
                      {}, {})  # fmt: skip
    assert not most.passed
