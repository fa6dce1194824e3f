"""The `admission` settings: defaults that match the policy's, and cross-field checks whose
one-line message names the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from appliance.config.settings import AdmissionSettings
from appliance.config.settings_load import load
from appliance.domain.errors import ConfigError
from appliance.policy.admission import AdmissionLimits


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("APPLIANCE_"):
            monkeypatch.delenv(name)


def test_the_settings_build_the_policy_limits_with_the_same_defaults() -> None:
    limits = AdmissionLimits(**AdmissionSettings().model_dump(exclude={"task_idle_s"}))
    assert limits == AdmissionLimits()


def test_tenant_maps_come_from_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "a.yaml"
    cfg.write_text("admission: {tenant_weights: {acme: 3}, priority_ceilings: {acme: 2}}\n")
    s = load(cfg).admission
    assert (s.tenant_weights, s.priority_ceilings) == ({"acme": 3.0}, {"acme": 2})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "admission: {max_children_per_task: 100, max_open_tasks: 50}\n",
            "exceeds admission.max_open_tasks=50: lower the first or raise the second",
        ),
        (
            "admission: {priority_ceilings: {batch: -3}}\n",
            "admission.priority_ceilings.batch=-3 leaves a queue bound of 0 s",
        ),
        (
            "admission: {default_priority_ceiling: -1, queue_s_per_priority: 40}\n",
            "admission.default_priority_ceiling=-1 leaves a queue bound of 0 s",
        ),
        ("admission: {tenant_weights: {acme: 0}}\n", "admission.tenant_weights.acme=0"),
    ],
)
def test_inconsistent_values_are_one_line_naming_the_fix(
    tmp_path: Path, text: str, expected: str
) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as err:
        load(cfg)
    assert expected in err.value.message
    assert "\n" not in err.value.message
