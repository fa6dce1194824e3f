"""Settings -> the tool-call and structured-output flags of every vLLM worker."""

from __future__ import annotations

import re

import pytest

from appliance.config.settings import EngineSettings
from appliance.engines.supervision.launch import Device, plan_workers, spec_from_settings
from tests.unit.test_worker_launch import flag


@pytest.mark.parametrize(
    ("fields", "parser", "auto", "structured"),
    [
        ({}, "hermes", "", '{"backend":"xgrammar","disable_any_whitespace":true}'),
        (
            {"tool_call_parser": "llama3_json", "structured_outputs_backend": "guidance"},
            "llama3_json",
            "",
            '{"backend":"guidance","disable_any_whitespace":true}',
        ),
        (
            {"enable_auto_tool_choice": False, "compact_json": False},
            "hermes",
            None,
            '{"backend":"xgrammar"}',
        ),
        (
            {
                "enable_auto_tool_choice": False,
                "tool_call_parser": None,
                "compact_json": False,
                "structured_outputs_backend": "auto",
            },
            None,
            None,
            None,
        ),
    ],
)
def test_workers_get_the_tool_and_json_flags(
    fields: dict, parser: str | None, auto: str | None, structured: str | None
) -> None:
    engine = EngineSettings(model="/m/tiny", **fields)
    argv = plan_workers(spec_from_settings(engine, python="/p", device=Device.CPU), {})[0].argv
    got = [flag(argv, f) for f in ("--tool-call-parser", "--enable-auto-tool-choice")]
    assert [*got, flag(argv, "--structured-outputs-config")] == [parser, auto, structured]


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"tool_call_parser": None}, "needs engine.tool_call_parser"),
        ({"structured_outputs_backend": "outlines"}, "compact_json needs"),
    ],
)
def test_flags_vllm_would_refuse_together(fields: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineSettings(**fields)
