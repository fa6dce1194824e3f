"""The `appliance` command as a user runs it: a real process, its stdout, stderr and exit code."""

from __future__ import annotations

import dataclasses
import os
import socket
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.ports import free_port
from tests.running import appliance_process

ROOT = Path(__file__).resolve().parents[2]
APPLIANCE = Path(sys.executable).parent / "appliance"


def run(*args: str, data_dir: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    if data_dir is not None:
        base["APPLIANCE_DATA_DIR"] = str(data_dir)
    return subprocess.run(
        [str(APPLIANCE), *args], capture_output=True, text=True, env={**base, **env}, timeout=60
    )


def test_help_lists_every_command_of_the_interface() -> None:
    out = run("--help").stdout
    for command in (
        "up",
        "status",
        "top",
        "sessions",
        "tasks",
        "costs",
        "replay",
        "bench",
        "sim",
        "profile",
        "doctor",
        "config",
        "keys",
        "stop",
        "reload",
        "service",
    ):
        assert f" {command} " in out, command
    assert "--install-completion" in out and "--show-completion" in out


def test_config_show_prints_the_effective_configuration(tmp_path: Path) -> None:
    r = run("config", "show", data_dir=tmp_path, APPLIANCE_SERVER__PORT="9123")
    assert r.returncode == 0, r.stderr
    assert "port: 9123" in r.stdout and f"data_dir: {tmp_path}" in r.stdout


@pytest.mark.parametrize(
    ("env", "text", "needle"),
    [
        ({"APPLIANCE_SERVER__PORT": "eighty"}, None, "server.port='eighty' is invalid"),
        ({}, "engine: {wrokers: 2}\n", "unknown key 'engine.wrokers'"),
        ({}, "engine: {workers: 0}\n", "engine.workers=0 is invalid"),
    ],
)
def test_bad_config_exits_2_with_one_line(
    tmp_path: Path, env: dict[str, str], text: str | None, needle: str
) -> None:
    args = ["config", "show"]
    if text is not None:
        cfg = tmp_path / "c.yaml"
        cfg.write_text(text)
        args += ["--config", str(cfg)]
    r = run(*args, data_dir=tmp_path, **env)
    assert r.returncode == 2
    assert needle in r.stderr and r.stderr.count("\n") == 1
    assert r.stdout == ""


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    r = run("config", "show", data_dir=tmp_path, APPLIANCE_SERVER__PORT="x", APPLIANCE_DEBUG="1")
    assert r.returncode == 2 and "Traceback" in r.stderr


def test_keys_add_prints_only_the_key_and_keeps_the_file_private(tmp_path: Path) -> None:
    r = run("keys", "add", "alice", data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    key = r.stdout.strip()
    assert key.startswith("sk-app-") and len(r.stdout.splitlines()) == 1
    admin = run("keys", "add", "ops", "--admin", data_dir=tmp_path).stdout.strip()
    assert admin.startswith("sk-admin-")
    path = tmp_path / "api-keys.toml"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    listing = run("keys", "list", data_dir=tmp_path).stdout
    assert "alice\ttenant" in listing and "ops\tadmin" in listing
    assert key not in listing and admin not in listing
    again = run("keys", "add", "alice", data_dir=tmp_path)
    assert again.returncode == 2 and "exists already" in again.stderr
    assert key in path.read_text()  # nothing lost by the refused add


def test_keys_show_prints_that_key_only_and_an_unknown_name_is_one_line(tmp_path: Path) -> None:
    key = run("keys", "add", "alice", data_dir=tmp_path).stdout.strip()
    run("keys", "add", "ops", "--admin", data_dir=tmp_path)
    shown = run("keys", "show", "alice", data_dir=tmp_path)
    assert (shown.returncode, shown.stdout) == (0, key + "\n"), shown.stderr
    unknown = run("keys", "show", "bob", data_dir=tmp_path)
    assert unknown.returncode == 2 and unknown.stdout == ""
    assert unknown.stderr == (
        f"appliance: no key named 'bob' in {tmp_path / 'api-keys.toml'} (keys: alice, ops)\n"
    )


def test_bad_key_name_is_refused(tmp_path: Path) -> None:
    r = run("keys", "add", "no spaces", data_dir=tmp_path)
    assert r.returncode == 2 and "key name 'no spaces' is invalid" in r.stderr


def test_unwritable_data_dir_is_one_line(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("keep me")
    r = run("keys", "add", "alice", data_dir=blocker / "sub")
    assert r.returncode == 2
    assert "data dir" in r.stderr and "cannot create it" in r.stderr
    assert r.stderr.count("\n") == 1
    assert blocker.read_text() == "keep me"


def test_doctor_reports_each_check_and_fails_on_a_taken_port(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run("doctor", data_dir=tmp_path, APPLIANCE_SERVER__PORT=str(port))
    names = [line.split()[1] for line in r.stdout.splitlines()]
    assert names[:3] == ["python", "gpus", "vllm"]
    assert any(line.startswith("fail") and "port" in line for line in r.stdout.splitlines())
    assert r.returncode == 1
    free = run("doctor", data_dir=tmp_path, APPLIANCE_SERVER__PORT=str(port))
    assert free.returncode == 0, free.stdout
    assert f"ok    data dir  {tmp_path} writable" in free.stdout


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    readme = (ROOT / "README.md").read_text().splitlines()
    commands = [line for line in readme[:6] if line.startswith("./install.sh")]
    assert len(commands) == 2, "README opens with exactly two commands"
    assert "appliance up" in commands[0]
    assert commands[1] in (ROOT / ".ci/run").read_text().splitlines()


def _ledger_with_one_success(path: Path) -> None:
    """A ledger holding one verified task that cost two attempts, written by the product code."""
    from appliance.domain.records import (
        CostMode,
        Price,
        SessionId,
        TaskEvent,
        TaskEventType,
        TaskId,
        TaskRecord,
        TenantId,
        TurnId,
        TurnOutcome,
        TurnRecord,
        WorkerId,
    )
    from appliance.ledger import LedgerWriter

    with LedgerWriter.open(path) as ledger:
        ledger.set_price(
            Price(
                mode=CostMode.TOKENS,
                effective_from=0.0,
                fresh_per_mtok=1.0,
                cached_per_mtok=0.0,
                output_per_mtok=2.0,
                reasoning_per_mtok=0.0,
                gpu_second=0.0,
            )
        ).result()
        ledger.record_task(
            TaskRecord(TaskId("t1"), TenantId("acme"), 10.0, task_class="code")
        ).result()
        for i, outcome in enumerate((TurnOutcome.FAILED, TurnOutcome.OK)):
            ledger.record_turn(
                TurnRecord(
                    turn_id=TurnId(f"u{i}"),
                    tenant=TenantId("acme"),
                    task_id=TaskId("t1"),
                    session_id=SessionId("s1"),
                    worker=WorkerId("w0"),
                    model="m",
                    prompt_tokens=1_000_000,
                    cached_tokens=0,
                    output_tokens=500_000,
                    outcome=outcome,
                    started_at=11.0 + i,
                    finished_at=11.5 + i,
                )
            ).result()
        ledger.record_task_event(
            TaskEvent(TaskId("t1"), TaskEventType.SUCCEEDED, 20.0, verified=True)
        ).result()


def test_costs_reads_a_ledger_file_offline(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    _ledger_with_one_success(db)
    r = run("costs", "--db", str(db), "--json", data_dir=tmp_path)
    assert r.returncode == 0, r.stderr
    import json

    (row,) = json.loads(r.stdout)
    # Two attempts of 1M fresh tokens at 1/M plus 0.5M output at 2/M: 2 each, 4 in all.
    assert row["task_class"] == "code" and row["tenant"] == "acme"
    assert row["succeeded"] == 1 and row["attempts"] == 2
    assert row["cost_per_success"] == pytest.approx(4.0)
    table = run("costs", "--db", str(db), data_dir=tmp_path).stdout
    assert "cost_per_success" in table.splitlines()[0] and "acme" in table


def test_costs_shows_the_boxs_overhead_beside_the_direct_cost(tmp_path: Path) -> None:
    from appliance.domain.records import (
        CostMode,
        Price,
        TaskEvent,
        TaskEventType,
        TaskId,
        TaskRecord,
        TenantId,
        TurnId,
        TurnOutcome,
        TurnRecord,
        WorkerId,
    )
    from appliance.domain.usage import UsagePeriod, WorkerUsage
    from appliance.ledger import LedgerWriter

    db = tmp_path / "ledger.db"
    w0 = WorkerId("w0")
    with LedgerWriter.open(db) as ledger:
        price = Price(CostMode.GPU_SECONDS, 0.0, gpu_second=0.001, box_per_hour=3.6)
        ledger.set_price(price).result()
        ledger.record_task(TaskRecord(TaskId("t1"), TenantId("acme"), 10.0, task_class="code"))
        acme, t1 = TenantId("acme"), TaskId("t1")
        ok = TurnOutcome.OK
        turn = TurnRecord(TurnId("u1"), acme, t1, None, w0, "m", 10, 0, 1, ok, 11.0, 12.0)
        ledger.record_turn(dataclasses.replace(turn, gpu_s=40.0))
        ledger.record_task_event(TaskEvent(TaskId("t1"), TaskEventType.SUCCEEDED, 20.0, True))
        # 100 s: 60 idle GPU-seconds (0.06) and the box's 100 s (0.1)
        ledger.record_usage(UsagePeriod(0.0, 100.0, (WorkerUsage(w0, 1, 100.0, 40.0),))).result()
    import json

    (row,) = json.loads(run("costs", "--db", str(db), "--json", data_dir=tmp_path).stdout)
    # direct 40 GPU-s * 0.001 = 0.04; with the overhead 0.2 per success
    assert row["cost"] == pytest.approx(0.04) and row["overhead"] == pytest.approx(0.16)
    assert row["cost_per_success"] == pytest.approx(0.2)
    assert row["direct_cost_per_success"] == pytest.approx(0.04)
    header, line, footer = run("costs", "--db", str(db), data_dir=tmp_path).stdout.splitlines()
    assert header.split()[-5:] == ["cost", "overhead", "total_cost", "cost_per_success", "currency"]
    assert line.split()[-5:] == ["0.04", "0.16", "0.2", "0.2", "USD"]
    assert footer == (
        "overhead 0.16 USD: idle GPU time 0.06, energy 0, the box 0.1; shared by GPU-seconds"
    )


def test_costs_refuses_a_file_that_is_not_a_ledger(tmp_path: Path) -> None:
    bogus = tmp_path / "notes.txt"
    bogus.write_text("these are my notes, not a database\n" * 10)
    before = bogus.read_bytes()
    r = run("costs", "--db", str(bogus), data_dir=tmp_path)
    assert r.returncode == 2 and r.stderr.count("\n") == 1
    assert str(bogus) in r.stderr and "Traceback" not in r.stderr
    assert bogus.read_bytes() == before


def test_up_on_a_taken_port_is_one_line_and_leaves_nothing_running(tmp_path: Path) -> None:
    import psutil

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        before = {p.pid for p in psutil.process_iter()}
        r = run("up", "--engine", "sim", "--port", str(port), data_dir=tmp_path)
    assert r.returncode == 2, r.stderr
    assert f"127.0.0.1:{port}" in r.stderr and r.stderr.count("\n") == 1
    new = [
        p
        for p in psutil.process_iter()
        if p.pid not in before and "cli.main" in " ".join(p.cmdline())
    ]
    assert new == []


@pytest.mark.vllm
@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--model", "/no/such/model"], {}, "model path /no/such/model does not exist"),
        (["--model", "/no/such/model"], {"APPLIANCE_ENGINE__PYTHON": "/no/python"}, "/no/python"),
        ([], {}, "engine.model is not set"),
    ],
)
def test_up_with_vllm_refuses_bad_input_in_one_line(
    args: list[str], env: dict[str, str], needle: str, tmp_path: Path, vllm_python: str
) -> None:
    env = {"APPLIANCE_ENGINE__PYTHON": vllm_python, **env}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    r = run("up", "--engine", "vllm", "--port", port, *args, data_dir=tmp_path, **env)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr and r.stderr.count("\n") == 1
    assert "Traceback" not in r.stderr


def test_replay_prints_the_comparison_and_writes_the_report(tmp_path: Path) -> None:
    from tests.paths import MOONCAKE

    out = tmp_path / "report.json"
    r = run(
        "replay",
        str(MOONCAKE),
        "--limit",
        "200",
        "--workers",
        "2",
        "--policy",
        "appliance",
        "--policy",
        "round-robin",
        "--report",
        str(out),
        data_dir=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "appliance" in r.stdout and "round-robin" in r.stdout
    import json

    report = json.loads(out.read_text())
    assert set(report["bounds"]) == {"no_cache", "unbounded", "optimal"}
    assert set(report["policies"]) == {"appliance", "round-robin"}
    for name in ("no_cache", "unbounded", "optimal"):
        assert report["bounds"][name]["fresh_prefill_tokens"] > 0


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["no-such-trace.jsonl"], "does not exist"),
        (["{trace}", "--policy", "magic"], "unknown routing policy magic"),
    ],
)
def test_replay_bad_input_is_one_line(args: list[str], needle: str, tmp_path: Path) -> None:
    from tests.paths import MOONCAKE

    r = run("replay", *[a.format(trace=MOONCAKE) for a in args], data_dir=tmp_path)
    assert r.returncode == 2 and needle in r.stderr and r.stderr.count("\n") == 1


def test_status_of_an_appliance_that_is_not_running_exits_1(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = run("status", "--url", f"http://127.0.0.1:{port}", "--key", "k", data_dir=tmp_path)
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_doctor_against_a_running_appliance_says_so(tmp_path: Path) -> None:
    """The API port is taken by an appliance that answers /health: not a failure."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        r = run("doctor", data_dir=tmp_path, APPLIANCE_SERVER__PORT=str(port))
    finally:
        server.shutdown()
        server.server_close()
    port_line = next(line for line in r.stdout.splitlines() if line.split()[1] == "port")
    assert port_line.startswith("ok") and "serves a running appliance" in port_line


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"status": "ok"}'
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_second_up_on_the_same_data_dir_is_one_line(tmp_path: Path) -> None:
    """It would share the first one's ledger and logs: refused before anything starts."""
    with appliance_process(tmp_path, workers=1):
        r = run("up", "--engine", "sim", "--port", str(free_port()), data_dir=tmp_path)
    assert r.returncode == 2, r.stderr
    assert "in use by another appliance (pid" in r.stderr and r.stderr.count("\n") == 1


def test_a_taken_kv_event_port_under_sim_names_the_key_to_change(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        kv = taken.getsockname()[1]
        r = run(
            "up",
            "--engine",
            "sim",
            "--workers",
            "1",
            "--port",
            str(free_port()),
            data_dir=tmp_path,
            APPLIANCE_ENGINE__KV_EVENTS_BASE_PORT=str(kv),
            APPLIANCE_ENGINE__BASE_PORT=str(free_port()),
        )
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "engine.kv_events_base_port" in r.stderr and "external" not in r.stderr


def test_up_logs_at_its_level_and_says_when_it_drains_and_stops(tmp_path: Path) -> None:
    with appliance_process(tmp_path, workers=1, env={"APPLIANCE_LOG_LEVEL": "INFO"}) as up:
        pass  # stopped with SIGTERM, as Ctrl-C would
    log = up.log.read_text()
    assert "INFO appliance.engines.supervision.supervised_worker: worker w0 healthy" in log
    assert "SIGTERM: draining" in log and log.rstrip().endswith("appliance.start.daemon: stopped")
    with appliance_process(tmp_path, workers=1, env={"APPLIANCE_LOG_LEVEL": "ERROR"}) as up:
        pass
    assert "INFO" not in up.log.read_text()
