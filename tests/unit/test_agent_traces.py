"""The reader of kv-cache-tester's Claude Code sessions, on three real sessions
(tests/data/kvct) and on hand-made files: every field as the file has it, sub-agents started
together as one step, the think time a file lacks, and a clear refusal of bad input. Where
the whole folder is at hand, its figures are pinned to its stats.json and README."""

from __future__ import annotations

import gzip
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from appliance.workload import agent_traces
from appliance.workload.agent_traces import TraceRequest, TraceSubagents, read_agent_sessions
from appliance.workload.session_summary import sessions_summary
from tests.paths import DATA, data_file

KVCT = DATA / "kvct"
NO_THINK_TIME = data_file("kvct/trace_0058.json.gz")  # 4 requests, 3 without think_time
WAITED = data_file("kvct/trace_0277.json.gz")  # 4 sub-agents, the parent waits for them
BACKGROUND = data_file("kvct/trace_0295.json.gz")  # 8 sub-agents, 4 of them in the background
SESSIONS = (NO_THINK_TIME, WAITED, BACKGROUND)

FULL_TRACES_ENV = "APPLIANCE_TEST_TRACES"


def raw(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(gzip.decompress(path.read_bytes()))
    return data


def flat(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every request in file order, a sub-agent entry's requests in its place."""
    return [r for e in entries for r in (e["requests"] if e["type"] == "subagent" else [e])]


@pytest.mark.parametrize("path", SESSIONS, ids=lambda p: p.name)
def test_a_session_keeps_every_field_of_its_file(path: Path) -> None:
    (session,) = read_agent_sessions(path)
    data = raw(path)
    assert (session.session_id, session.block_size, session.hash_id_scope) == (
        data["id"],
        64,
        "local",
    )
    assert (session.system_tokens, session.tool_tokens) == (
        data["system_tokens"],
        data["tool_tokens"],
    )
    expected = flat(data["requests"])
    got = list(session.requests())
    assert len(got) == len(expected)
    for r, e in zip(got, expected, strict=True):
        assert (r.t_s, r.input_tokens, r.output_tokens, r.model) == (
            e["t"],
            e["in"],
            e["out"],
            e["model"],
        )
        assert r.hash_ids == tuple(e["hash_ids"])
        assert len(r.hash_ids) == r.input_tokens // 64  # whole blocks only, in every file
        assert (r.stop, r.api_time_s) == (e["stop"] or None, e.get("api_time"))
        assert r.ends_in_tool_call == (e["stop"] == "tool_use")
        assert r.think_time_s == e.get("think_time", r.think_time_s)
    assert session.max_input_tokens == max(e["in"] for e in expected)


def test_a_missing_think_time_is_the_gap_from_the_previous_request() -> None:
    """trace_0058 records neither think nor API time after its first request: the gap
    between starts stands in, as kv-cache-tester's fallback."""
    (session,) = read_agent_sessions(NO_THINK_TIME)
    requests = session.own_requests()
    assert [r.t_s for r in requests] == [0.0, 8.0, 13.0, 45.0]
    assert [r.think_time_s for r in requests] == [0.0, 8.0, 5.0, 32.0]
    assert [r.stop for r in requests] == [None, None, None, "end_turn"]
    assert [r.api_time_s for r in requests] == [None, None, None, 2.3]
    assert session.subagent_steps() == ()


def test_sub_agents_started_together_are_one_step_the_parent_waits_for() -> None:
    (session,) = read_agent_sessions(WAITED)
    kinds = ["sub" if isinstance(s, TraceSubagents) else "req" for s in session.steps]
    assert kinds == ["req", "sub"] + ["req"] * 6 + ["sub"] + ["req"] * 2
    together, alone = session.subagent_steps()
    assert [a.agent_id for a in together.agents] == ["agent_001", "agent_002", "agent_003"]
    assert [len(a.requests) for a in together.agents] == [4, 12, 17]
    assert [(a.agent_type, a.system_tokens, a.tool_tokens) for a in alone.agents] == [
        ("Plan", 1129, 7401)
    ]
    assert together.parent_waits and alone.parent_waits
    assert [a.requests[0].think_time_s for a in together.agents] == [0.0, 0.0, 0.0]
    launcher, after = session.steps[0], session.steps[2]
    assert isinstance(launcher, TraceRequest) and isinstance(after, TraceRequest)
    assert launcher.api_time_s is not None
    answered = launcher.t_s + launcher.api_time_s  # 18.78 s
    for agent in together.agents:
        assert agent.duration_s is not None
        assert answered <= agent.start_s < answered + 1  # each entry's t is its end
        # the parent's next think time counts from the answer: it covers the sub-agents' run
        assert after.think_time_s > agent.duration_s
        assert after.t_s >= agent.t_s
    assert len(list(session.requests())) == 9 + 4 + 12 + 17 + 11


def test_sub_agents_in_the_background_do_not_hold_the_parent() -> None:
    (session,) = read_agent_sessions(BACKGROUND)
    steps = list(enumerate(session.steps))
    background = [(i, s) for i, s in steps if isinstance(s, TraceSubagents) and not s.parent_waits]
    assert [(i, len(s.agents)) for i, s in background] == [(66, 3), (68, 1)]
    for i, step in background:
        after = session.steps[i + 1]
        assert isinstance(after, TraceRequest)
        for agent in step.agents:
            assert (agent.status, agent.duration_s) == ("async_launched", None)
            assert agent.start_s == agent.t_s
            assert after.t_s < agent.start_s + agent.requests[-1].t_s  # the parent went on
    assert sum(len(s.agents) for s in session.subagent_steps()) == 8


def test_the_summary_of_the_slice_counts_what_the_files_hold() -> None:
    sessions = read_agent_sessions(KVCT)  # README.md and LICENSE.upstream are not sessions
    assert [s.session_id for s in sessions] == ["trace_0058", "trace_0277", "trace_0295"]
    entries = [e for p in SESSIONS for e in raw(p)["requests"]]
    own = [e for e in entries if e["type"] != "subagent"]
    agents = [e for e in entries if e["type"] == "subagent"]
    inputs = sorted(e["in"] for e in own)
    stops: dict[str, int] = {}
    for e in own:
        stops[e["stop"] or "none"] = stops.get(e["stop"] or "none", 0) + 1
    assert sessions_summary(sessions) == {
        "sessions": 3,
        "requests": len(own),
        "subagent_steps": 7,
        "subagent_entries": len(agents),
        "subagent_requests": sum(len(a["requests"]) for a in agents),
        "sessions_with_subagents": 2,
        "tool_use_requests": stops["tool_use"],
        "stops": stops,
        "input_tokens_p50": inputs[int(0.5 * (len(inputs) - 1))],
        "input_tokens_p90": inputs[int(0.9 * (len(inputs) - 1))],
        "max_input_tokens": max(e["in"] for e in flat(entries)),
    }
    assert (len(own), len(agents)) == (4 + 9 + 324, 12)


def test_a_folder_is_read_by_name_and_its_other_files_ignored(tmp_path: Path) -> None:
    write(tmp_path / "b.json", {"id": "second", "requests": [request()]})
    (tmp_path / "a.json.gz").write_bytes(gzip.compress(json.dumps(session()).encode()))
    for other in ("notes.txt", "stats.json", "b.stats.json"):
        (tmp_path / other).write_text("{}")
    sessions = read_agent_sessions(str(tmp_path))
    assert [s.session_id for s in sessions] == ["a", "second"]  # no id: the file's name
    assert read_agent_sessions(tmp_path / "b.json")[0].session_id == "second"


def test_a_missing_think_time_leaves_out_the_previous_api_time(tmp_path: Path) -> None:
    path = write(
        tmp_path / "s.json",
        session(
            request(t=0.0, api_time=2.5),
            request(t=10.0, think_time=None),
            request(t=12.0, think_time=1.5, api_time=0.0, stop="end_turn"),
        ),
    )
    requests = read_agent_sessions(path)[0].own_requests()
    assert [r.think_time_s for r in requests] == [0.0, 7.5, 1.5]
    assert [r.api_time_s for r in requests] == [2.5, None, 0.0]
    assert [r.ends_in_tool_call for r in requests] == [True, True, False]


def test_a_re_sent_prefix_shares_its_ids_and_a_new_one_does_not(tmp_path: Path) -> None:
    """Shared id objects keep all 471 sessions (61 M ids) in memory; the ids stay exact."""
    ids = [[1000, 1001], [1000, 1001, 1002], [1000, 2001, 1002], [1000, 2001]]
    path = write(
        tmp_path / "s.json",
        session(*(request(t=float(i), n_in=64 * len(h), hash_ids=h) for i, h in enumerate(ids))),
    )
    requests = read_agent_sessions(path)[0].own_requests()
    assert [list(r.hash_ids) for r in requests] == ids
    assert requests[1].hash_ids[1] is requests[0].hash_ids[1]
    assert requests[3].hash_ids[1] is not requests[2].hash_ids[1]


def request(t: float = 0.0, n_in: int = 130, **fields: Any) -> dict[str, Any]:
    base = {"t": t, "type": "n", "model": "m", "in": n_in, "out": 5, "stop": "tool_use"}
    base["hash_ids"] = list(range(1, n_in // 64 + 1))
    base["think_time"] = 0.0 if t == 0.0 else 1.0
    return {k: v for k, v in {**base, **fields}.items() if v is not None}


def session(*requests: dict[str, Any]) -> dict[str, Any]:
    return {"block_size": 64, "hash_id_scope": "local", "requests": list(requests or [request()])}


def subagent(*requests: dict[str, Any], **fields: Any) -> dict[str, Any]:
    entry = {"t": 5.0, "type": "subagent", "agent_id": "agent_001", "status": "completed"}
    return {**entry, "requests": list(requests), **fields}


def write(path: Path, data: object) -> Path:
    path.write_bytes(json.dumps(data).encode())
    return path


BAD_SESSIONS: list[tuple[object, str]] = [
    ([request()], "not a JSON object"),
    ({"id": "x"}, "no `requests` list"),
    ({"requests": []}, "`requests` is empty"),
    (session(request(), {"t": 1.0, "out": 5, "hash_ids": []}), r"requests\[1\]: no `in`"),
    (session(request(out=-1)), r"requests\[0\]: `out` is -1, not a whole number"),
    (session(request(**{"in": True})), r"requests\[0\]: `in` is True, not a whole number"),
    (session(request(think_time=-2.0)), r"requests\[0\]: `think_time` is -2.0"),
    (session({**request(), "t": "soon"}), r"requests\[0\]: `t` is 'soon'"),
    (session(request(hash_ids=[1])), r"requests\[0\]: 1 hash ids for 130 tokens"),
    (
        session(request(), request(t=1.0, n_in=192, hash_ids=[1, 2, -5])),
        r"requests\[1\]: hash id -5 is not a whole number",
    ),
    (session(request(t=3.0), request(t=2.0)), r"requests\[1\]: starts at 2.0 s, before"),
    (session(request(stop=7)), r"requests\[0\]: `stop` is 7, not a string"),
    (session(request(), {**subagent(), "requests": None}), r"requests\[1\]: a sub-agent without"),
    (
        session(request(), subagent(request(), request(t=1.0, out=None))),
        r"requests\[1\]\.requests\[1\]: no `out`",
    ),
    (
        session(request(), subagent(subagent(request()))),
        r"requests\[1\]\.requests\[0\]: a sub-agent inside a sub-agent",
    ),
    ({**session(), "block_size": 0}, "`block_size` is 0"),
]


@pytest.mark.parametrize(("data", "fault"), BAD_SESSIONS, ids=[f for _, f in BAD_SESSIONS])
def test_a_bad_session_is_refused_naming_its_file_and_fault(
    tmp_path: Path, data: object, fault: str
) -> None:
    path = write(tmp_path / "bad.json", data)
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))}: {fault}"):
        read_agent_sessions(tmp_path)


def test_the_hand_made_session_reads_when_nothing_is_wrong(tmp_path: Path) -> None:
    """The bad sessions above fail for their one fault, not for the shape they share."""
    good = session(request(), subagent(request(), request(t=1.0)), request(t=9.0))
    (read,) = read_agent_sessions(write(tmp_path / "good.json", good))
    assert [type(s) for s in read.steps] == [TraceRequest, TraceSubagents, TraceRequest]
    assert [len(s.agents[0].requests) for s in read.subagent_steps()] == [2]


@pytest.mark.parametrize(
    ("name", "content", "fault"),
    [
        ("bad.json", b"{nope", "not JSON"),
        ("bad.json.gz", b"not gzip at all", "cannot read it"),
        ("bad.json.gz", gzip.compress(b'{"requests": '), "not JSON"),
    ],
)
def test_a_file_that_is_not_a_session_is_refused(
    tmp_path: Path, name: str, content: bytes, fault: str
) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / name))}: {fault}"):
        read_agent_sessions(tmp_path / name)


@pytest.mark.parametrize("name", ["big.json", "big.json.gz"])
def test_a_file_over_the_bound_is_refused_uncompressed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    text = json.dumps(session(request(model="x" * 200))).encode()
    (tmp_path / name).write_bytes(gzip.compress(text) if name.endswith(".gz") else text)
    assert read_agent_sessions(tmp_path / name)[0].own_requests()[0].model == "x" * 200
    monkeypatch.setattr(agent_traces, "MAX_FILE_BYTES", len(text) - 1)
    with pytest.raises(ValueError, match=f"larger than {len(text) - 1:,} bytes uncompressed"):
        read_agent_sessions(tmp_path / name)


def test_an_empty_or_missing_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "README.md").write_text("no sessions here")
    (tmp_path / "stats.json").write_text("{}")
    with pytest.raises(ValueError, match="holds no session file"):
        read_agent_sessions(tmp_path)
    with pytest.raises(ValueError, match="no such file or folder"):
        read_agent_sessions(tmp_path / "absent")


def full_folder() -> Path:
    """The whole folder, under $APPLIANCE_TEST_TRACES (as the trace replay's full check:
    tests/unit/test_replay_bounds.py); skipped, with the reason, where it is unset: the
    slice's tests above stand in."""
    root = os.environ.get(FULL_TRACES_ENV)
    if not root:
        pytest.skip(f"${FULL_TRACES_ENV} unset: no full folder of sessions to check")
    folder = Path(root) / "claude_code_kvct"
    assert folder.is_dir(), f"${FULL_TRACES_ENV}={root} holds no claude_code_kvct/"
    return folder


def test_the_whole_folder_matches_its_statistics() -> None:
    """471 sessions, 31,426 requests plus 453 in 41 sub-agents of 10 sessions (README);
    stop reasons and input percentiles as stats.json has them. About 4 s."""
    folder = full_folder()
    stats = json.loads((folder / "stats.json").read_text())
    summary = sessions_summary(read_agent_sessions(folder))
    assert summary["sessions"] == stats["traces"] == 471
    assert summary["requests"] == stats["requests_top_level"] == 31_426
    assert summary["subagent_entries"] == stats["subagent_entries"] == 41
    assert summary["subagent_requests"] == stats["subagent_requests"] == 453
    assert summary["sessions_with_subagents"] == 10
    assert summary["subagent_steps"] == 24
    assert summary["stops"] == stats["stop_reasons"]
    assert summary["tool_use_requests"] == stats["stop_reasons"]["tool_use"] == 26_702
    assert summary["input_tokens_p50"] == stats["input_tokens"]["p50"]
    assert summary["input_tokens_p90"] == stats["input_tokens"]["p90"]
