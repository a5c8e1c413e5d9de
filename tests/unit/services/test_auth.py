"""API keys: file parsing, lookup, header extraction, admin rights."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.gateway.auth import ANONYMOUS, ApiKeys, AuthError, Principal, key_from_headers

KEYS = """
# tenant   key                      options
acme       acme-secret-key-0001
globex     globex-secret-key-0002   tpm=5000
ops        ops-admin-key-000000003  admin
"""


@pytest.fixture
def keys(tmp_path: Path) -> ApiKeys:
    path = tmp_path / "keys"
    path.write_text(KEYS)
    return ApiKeys.from_file(path)


def test_keys_map_to_their_tenant_and_options(keys: ApiKeys) -> None:
    assert len(keys) == 3
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
        ("a acme-secret-key-0001\nb acme-secret-key-0001", "twice"),
        ("# only a comment", "no keys"),
    ],
)
def test_bad_keys_files_name_the_line(tmp_path: Path, text: str, error: str) -> None:
    path = tmp_path / "keys"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        ApiKeys.from_file(path)


def test_key_from_headers() -> None:
    assert key_from_headers([("Authorization", "Bearer abc")]) == "abc"
    assert key_from_headers([("authorization", b"bearer  abc ")]) == "abc"
    assert key_from_headers([("x-api-key", "k1")]) == "k1"
    assert key_from_headers([("x-api-key", "k1"), ("authorization", "Bearer k2")]) == "k2"
    assert key_from_headers([("authorization", "Basic xyz")]) is None
    assert key_from_headers([]) is None
