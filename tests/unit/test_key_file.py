"""The key file as a running appliance reads it: a key added or revoked takes effect within
a check interval, and a broken file keeps the last good keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.config.keystore import ApiKeyError, KeyFile, add_key, find_key, revoke_key
from tests.fakes import ManualClock


def names(key_file: KeyFile) -> list[str]:
    return [k.name for k in key_file.current()]


def test_added_and_revoked_keys_take_effect_after_the_check_interval(tmp_path: Path) -> None:
    path = tmp_path / "api-keys.toml"
    add_key(path, "alice")
    clock = ManualClock(0.0)
    key_file = KeyFile(path, check_every_s=1.0, clock=clock.now)
    assert names(key_file) == ["alice"]
    add_key(path, "bob")
    assert names(key_file) == ["alice"]  # not looked at again within the second
    clock.t += 1.0
    assert names(key_file) == ["alice", "bob"]
    revoke_key(path, "alice")
    clock.t += 1.0
    assert names(key_file) == ["bob"]


def test_a_broken_file_keeps_the_last_good_keys(tmp_path: Path) -> None:
    path = tmp_path / "api-keys.toml"
    add_key(path, "alice")
    clock = ManualClock(0.0)
    key_file = KeyFile(path, clock=clock.now)
    version = (names(key_file), key_file.version)
    path.write_text("[keys.alice\\nbroken")
    clock.t += 5.0
    assert (names(key_file), key_file.version) == version


def test_revoking_an_unknown_key_names_the_known_ones(tmp_path: Path) -> None:
    path = tmp_path / "api-keys.toml"
    add_key(path, "alice")
    with pytest.raises(ApiKeyError, match=r"no key named 'bob'.*\(keys: alice\)"):
        revoke_key(path, "bob")


def test_a_key_is_found_by_name_and_an_unknown_name_lists_the_known(tmp_path: Path) -> None:
    path = tmp_path / "api-keys.toml"
    alice = add_key(path, "alice")
    add_key(path, "ops", admin=True)
    assert find_key(path, "alice") == alice
    with pytest.raises(ApiKeyError) as err:
        find_key(path, "bob")
    assert err.value.message == f"no key named 'bob' in {path} (keys: alice, ops)"
    assert err.value.exit_code == 2
