"""API keys: file parsing, lookup, header extraction, admin rights, priority classes."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.priority import Priority
from services.gateway.access.auth import ANONYMOUS, ApiKeys, AuthError, Principal, key_from_headers

KEYS = """
# tenant   key                      options
acme       acme-secret-key-0001
globex     globex-secret-key-0002   tpm=5000
ops        ops-admin-key-000000003  admin
batch      batch-secret-key-000004  class=sheddable weight=0.5
paying     paying-secret-key-00005  max_class=critical weight=3
vip        vip-secret-key-00000006  class=critical tpm=100
"""


@pytest.fixture
def keys(tmp_path: Path) -> ApiKeys:
    path = tmp_path / "keys"
    path.write_text(KEYS)
    return ApiKeys.from_file(path)


def test_keys_map_to_their_tenant_and_options(keys: ApiKeys) -> None:
    assert len(keys) == 6
    assert keys.authenticate("acme-secret-key-0001") == Principal("acme")
    assert keys.authenticate("globex-secret-key-0002") == Principal("globex", False, 5000)
    assert keys.authenticate("ops-admin-key-000000003").admin


@pytest.mark.parametrize("key", [None, "", "acme-secret-key-0002", "acme-secret-key-0001 "])
def test_missing_or_wrong_key_is_unauthenticated(keys: ApiKeys, key: str | None) -> None:
    with pytest.raises(AuthError) as err:
        keys.authenticate(key)
    assert not err.value.denied


def test_admin_calls_are_denied_to_tenant_keys(keys: ApiKeys) -> None:
    with pytest.raises(AuthError, match="admin") as err:
        keys.authenticate("acme-secret-key-0001").require_admin("ClusterStatus")
    assert err.value.denied
    keys.authenticate("ops-admin-key-000000003").require_admin("ClusterStatus")
    ANONYMOUS.require_admin("ClusterStatus")  # no keys file: one trusted tenant


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("acme short", "at least 16"),
        ("acme", "expected"),
        ("bad/tenant acme-secret-key-0001", "tenant"),
        ("acme acme-secret-key-0001 root", "unknown option"),
        ("acme acme-secret-key-0001 tpm=lots", "unknown option"),
        ("acme acme-secret-key-0001 class=urgent", "class must be one of sheddable, standard"),
        ("acme acme-secret-key-0001 max_class=", "max_class must be one of"),
        ("acme acme-secret-key-0001 class=critical max_class=standard", "above max_class"),
        ("acme acme-secret-key-0001 weight=0", "weight must be a number > 0"),
        ("acme acme-secret-key-0001 weight=-1", "weight must be a number > 0"),
        ("acme acme-secret-key-0001 weight=nan", "weight must be a number > 0"),
        ("acme acme-secret-key-0001 weight=inf", "weight must be a number > 0"),
        ("acme acme-secret-key-0001 weight=heavy", "weight must be a number > 0"),
        ("acme acme-secret-key-0001 class=standard class=critical", "given twice"),
        ("acme acme-secret-key-0001 priority=critical", "unknown option"),
        ("a acme-secret-key-0001\nb acme-secret-key-0001", "twice"),
        ("# only a comment", "no keys"),
    ],
)
def test_bad_keys_files_name_the_line(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "keys"
    path.write_text(f"# a comment first\n{text}")
    with pytest.raises(ValueError, match=error) as err:
        ApiKeys.from_file(path)
    if error not in ("no keys", "twice"):  # those are about the whole file
        assert str(err.value).startswith(f"{path}:2: ")


def test_class_options_and_their_defaults(keys: ApiKeys) -> None:
    plain = keys.authenticate("acme-secret-key-0001")
    assert (plain.default_class, plain.max_class, plain.weight) == (
        Priority.STANDARD, Priority.STANDARD, 1.0,
    )  # fmt: skip
    batch = keys.authenticate("batch-secret-key-000004")
    assert (batch.default_class, batch.max_class, batch.weight) == (
        Priority.SHEDDABLE, Priority.STANDARD, 0.5,
    )  # fmt: skip
    paying = keys.authenticate("paying-secret-key-00005")
    assert (paying.default_class, paying.max_class, paying.weight) == (
        Priority.STANDARD, Priority.CRITICAL, 3.0,
    )  # fmt: skip
    # A default above standard is a class the key may ask for.
    vip = keys.authenticate("vip-secret-key-00000006")
    assert (vip.default_class, vip.max_class, vip.tokens_per_minute) == (
        Priority.CRITICAL, Priority.CRITICAL, 100,
    )  # fmt: skip


def test_a_request_gets_its_keys_default_or_asks_up_to_its_highest(keys: ApiKeys) -> None:
    batch = keys.authenticate("batch-secret-key-000004")
    assert batch.priority_for(None) is Priority.SHEDDABLE
    assert batch.priority_for(Priority.SHEDDABLE) is Priority.SHEDDABLE
    assert batch.priority_for(Priority.STANDARD) is Priority.STANDARD
    with pytest.raises(AuthError, match="priority: tenant 'batch' may ask for at most standard"):
        batch.priority_for(Priority.CRITICAL)
    paying = keys.authenticate("paying-secret-key-00005")
    assert paying.priority_for(None) is Priority.STANDARD
    assert paying.priority_for(Priority.CRITICAL) is Priority.CRITICAL
    # Without a keys file, the one anonymous caller may ask for any class.
    assert ANONYMOUS.priority_for(None) is Priority.STANDARD
    assert ANONYMOUS.priority_for(Priority.CRITICAL) is Priority.CRITICAL


def test_above_the_highest_class_is_permission_denied(keys: ApiKeys) -> None:
    with pytest.raises(AuthError) as err:
        keys.authenticate("acme-secret-key-0001").priority_for(Priority.CRITICAL)
    assert err.value.denied  # PERMISSION_DENIED, HTTP 403: the key is valid


def test_key_from_headers() -> None:
    assert key_from_headers([("Authorization", "Bearer abc")]) == "abc"
    assert key_from_headers([("authorization", b"bearer  abc ")]) == "abc"
    assert key_from_headers([("x-api-key", "k1")]) == "k1"
    assert key_from_headers([("x-api-key", "k1"), ("authorization", "Bearer k2")]) == "k2"
    assert key_from_headers([("authorization", "Basic xyz")]) is None
    assert key_from_headers([]) is None
