"""Settings: precedence of sources, and one-line errors that name the key, value and fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from appliance.config.settings import PORT_OFFSETS, Settings
from appliance.config.settings_load import load
from appliance.config.settings_yaml import documented_yaml
from appliance.domain.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("APPLIANCE_"):
            monkeypatch.delenv(name)


def test_defaults_without_any_source() -> None:
    s = load()
    assert s.server.port == 8080
    assert s.engine.kind == "auto"
    assert s.ledger_path == s.data_dir / "ledger.db"


def test_file_then_environment_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "a.yaml"
    cfg.write_text("server: {port: 9001, host: 127.0.0.2}\nengine: {workers: 3}\n")
    assert load(cfg).server.port == 9001
    monkeypatch.setenv("APPLIANCE_SERVER__PORT", "9002")
    s = load(cfg)
    assert (s.server.port, s.server.host, s.engine.workers) == (9002, "127.0.0.2", 3)
    s = load(cfg, server={"port": 9003, "host": None})
    assert (s.server.port, s.server.host) == (9003, "127.0.0.2")


def test_config_path_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "b.yaml"
    cfg.write_text("log_level: DEBUG\n")
    monkeypatch.setenv("APPLIANCE_CONFIG", str(cfg))
    assert load().log_level == "DEBUG"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("server: {prot: 1}\n", "unknown key 'server.prot'"),
        ("server: {port: 70000}\n", "server.port=70000 is invalid"),
        ("engine: {kind: gpu}\n", "engine.kind='gpu' is invalid"),
        ("engine: {kind: external}\n", "engine.kind=external needs engine.external_urls"),
        ("server: [1, 2\n", "not valid YAML"),
        ("- just\n- a list\n", "must be a mapping"),
    ],
)
def test_bad_file_is_one_clear_line(tmp_path: Path, text: str, expected: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load(cfg)
    assert expected in err.value.message
    assert "\n" not in err.value.message
    assert str(cfg) in err.value.message


def test_bad_value_names_what_is_expected(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("ledger: {synchronous: sometimes}\n")
    with pytest.raises(ConfigError) as err:
        load(cfg)
    assert "'sometimes'" in err.value.message
    assert "expected: SQLite synchronous mode" in err.value.message


def test_unknown_environment_key_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_SERVER__PROT", "1")
    with pytest.raises(ConfigError, match=r"APPLIANCE_SERVER__PROT: unknown key 'server\.prot'"):
        load()


def test_the_old_worker_reaper_key_is_read_with_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = tmp_path / "old.yaml"
    cfg.write_text("reaper: {worker_idle_s: 5}\nresidency: {reaper: false}\n")
    with caplog.at_level("WARNING", logger="appliance.config.settings_load"):
        s = load(cfg)
    assert (s.worker_reaper.worker_idle_s, s.residency.reaper) == (5.0, False)
    assert [r.getMessage() for r in caplog.records] == [
        f"config file {cfg}: 'reaper' is now 'worker_reaper'; rename the key"
    ]
    cfg.write_text("reaper: {worker_idle_s: 5}\nworker_reaper: {worker_idle_s: 6}\n")
    with pytest.raises(ConfigError, match=r"both 'reaper' and 'worker_reaper'"):
        load(cfg)


def test_the_old_worker_reaper_environment_key_names_the_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("APPLIANCE_WORKER_REAPER__MIN_AWAKE", "2")
    assert load().worker_reaper.min_awake == 2
    monkeypatch.setenv("APPLIANCE_REAPER__MIN_AWAKE", "2")
    with pytest.raises(ConfigError, match=r"set APPLIANCE_WORKER_REAPER__MIN_AWAKE instead$"):
        load()


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no-such\.yaml"):
        load(tmp_path / "no-such.yaml")


def test_documented_file_is_current_and_holds_the_defaults() -> None:
    text = (ROOT / "configs/appliance.yaml").read_text()
    assert text == documented_yaml(), "regenerate configs/appliance.yaml from documented_yaml()"
    values = yaml.safe_load(text)
    assert Settings(**values).model_dump(exclude={"data_dir"}) == Settings().model_dump(
        exclude={"data_dir"}
    )


def test_every_field_is_documented() -> None:
    def walk(model: type, prefix: str) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():  # type: ignore[attr-defined]
            sub = field.annotation
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                missing += walk(sub, f"{prefix}{name}.")
            elif not field.description:
                missing.append(prefix + name)
        return missing

    assert walk(Settings, "") == []


@pytest.mark.parametrize("host", ["0.0.0.0", "192.168.1.4", "::", "example.org"])
def test_keyless_auth_off_loopback_is_one_line_naming_the_key(tmp_path: Path, host: str) -> None:
    cfg = tmp_path / "open.yaml"
    cfg.write_text(f"server: {{auth: none, host: '{host}'}}\n")
    with pytest.raises(ConfigError) as err:
        load(cfg)
    assert err.value.exit_code == 2 and "\n" not in err.value.message
    assert "server.auth='none' is invalid" in err.value.message
    assert f"not {host!r}" in err.value.message and "loopback" in err.value.message


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_keyless_auth_on_loopback_is_accepted(host: str) -> None:
    assert load(server={"auth": "none", "host": host}).server.auth == "none"
    assert load().server.auth == "keys"  # keys unless asked


def test_engine_ports_left_unset_follow_the_api_port() -> None:
    engine = load().engine
    assert (engine.base_port, engine.kv_events_base_port, engine.kv_retention_base_port) == (
        None,
        None,
        None,
    )
    assert [engine.port_base(k) for k in PORT_OFFSETS] == [8100, 5557, 5657]
    assert [engine.port_base(k, 9000) for k in PORT_OFFSETS] == [9020, 6477, 6577]
    set_one = load(engine={"base_port": 7000}).engine
    assert set_one.port_base("base_port", 9000) == 7000


def test_model_aliases_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("APPLIANCE_API__MODEL_ALIASES", '{"claude-sonnet-4-5": "sim", "*": "sim"}')
    assert load().api.model_aliases == {"claude-sonnet-4-5": "sim", "*": "sim"}
