"""What a self-hoster runs against a running appliance, each against a real
`appliance up --engine sim`: `--version` (and the version `/health` and the state carry),
`up --gpus`, `stop` (graceful: a turn in flight finishes) and `reload` (a new key works at
once; live settings apply, the others are named)."""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from pathlib import Path

import httpx

from appliance import __version__
from tests.cli.test_cli import run
from tests.ports import free_port, free_port_block
from tests.running import add_key, appliance_process


def _admin(data_dir: Path) -> dict[str, str]:
    return {"Authorization": f"Bearer {add_key(data_dir, 'ops', '--admin')}"}


def test_version_and_gpus_as_given_with_the_mapping_printed(tmp_path: Path) -> None:
    r = run("--version")
    assert r.returncode == 0 and r.stdout == f"appliance {__version__}\n"
    ports = (free_port(), free_port_block(2), free_port_block(2))
    retention = {"APPLIANCE_ENGINE__KV_RETENTION_BASE_PORT": str(free_port_block(2))}
    # No --workers: one worker per listed GPU (gpus_per_worker 1).
    with appliance_process(
        tmp_path, workers=None, args=["--gpus", "3,5"], ports=ports, env=retention
    ) as up:
        health = httpx.get(f"{up.url}/health").json()
        state = httpx.get(f"{up.url}/admin/v1/state", headers=_admin(tmp_path)).json()
    assert health == {"status": "ok", "version": __version__}
    assert state["version"] == __version__
    assert [(w["id"], w["gpus"]) for w in state["workers"]] == [("w0", [3]), ("w1", [5])]
    assert [g["index"] for g in state["gpus"]] == [3, 5]  # the simulated GPUs carry the ids
    printed = up.log.read_text()
    assert f"appliance {__version__}: engine sim (2 workers" in printed
    assert "GPUs by worker (simulated: ids only): w0 -> 3; w1 -> 5" in printed


def test_up_refuses_too_few_gpus_or_a_bad_list_in_one_line(tmp_path: Path) -> None:
    few = run("up", "--engine", "sim", "--workers", "3", "--gpus", "0,1", data_dir=tmp_path)
    assert few.returncode == 2 and few.stderr.count("\n") == 1, few.stderr
    assert "needs 3 GPUs but engine.gpus lists 2" in few.stderr
    bad = run("up", "--engine", "sim", "--gpus", "0,one", data_dir=tmp_path)
    assert bad.returncode == 2 and "'0,one': give GPU indices separated by commas" in bad.stderr


def test_stop_drains_a_turn_in_flight_and_lets_the_data_dir_go(tmp_path: Path) -> None:
    slow = {"APPLIANCE_ENGINE__SIM_TIME_SCALE": "5"}  # a turn of 64 tokens takes seconds
    with appliance_process(tmp_path, workers=1, env=slow) as up:
        key = add_key(tmp_path, "alice")
        answer: dict[str, object] = {}
        started = threading.Event()

        def turn() -> None:
            body = {
                "model": "sim",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 64,
                "stream": True,
            }
            with httpx.stream(
                "POST",
                f"{up.url}/v1/chat/completions",
                json=body,
                timeout=60,
                headers={"Authorization": f"Bearer {key}"},
            ) as r:
                started.set()
                answer["status"] = r.status_code
                answer["text"] = "".join(r.iter_text())

        client = threading.Thread(target=turn)
        client.start()
        assert started.wait(30)
        r = run("stop", data_dir=tmp_path)
        client.join(60)
        assert r.returncode == 0, r.stderr
        assert r.stdout == f"stopped the appliance (pid {up.proc.pid}) on {tmp_path}\n"
        assert up.proc.wait(5) == 0  # stop returned after the process had gone
    assert answer["status"] == 200 and str(answer["text"]).rstrip().endswith("data: [DONE]")
    log = up.log.read_text()
    assert "SIGTERM: draining" in log and log.rstrip().endswith("appliance.start.daemon: stopped")
    again = run("stop", data_dir=tmp_path)
    assert again.returncode == 1 and again.stderr.count("\n") == 1
    assert f"no appliance is running on data dir {tmp_path}" in again.stderr


def test_reload_makes_a_new_key_work_at_once_and_applies_live_settings(tmp_path: Path) -> None:
    config = tmp_path / "appliance.yaml"
    config.write_text("log_level: INFO\ncosts: {fresh_per_mtok: 3.0}\n")
    with appliance_process(tmp_path, workers=1, args=["--config", str(config)]) as up:
        key = add_key(tmp_path, "bob")
        r = run("reload", data_dir=tmp_path)
        assert r.returncode == 0, r.stderr
        models = httpx.get(f"{up.url}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert models.status_code == 200  # at once: no wait for the key file's next look
        assert "API keys read again (3)" in r.stdout and "applied: no change" in r.stdout

        config.write_text(
            "log_level: DEBUG\ncosts: {fresh_per_mtok: 5.0}\nrouting: {reuse_weight: 3.0}\n"
        )
        r = run("reload", data_dir=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "applied: costs.fresh_per_mtok, log_level" in r.stdout
        assert "only after a restart: routing.reuse_weight" in r.stdout

        config.write_text("engine: {wrokers: 2}\n")
        bad = run("reload", data_dir=tmp_path)
        assert bad.returncode == 1 and "config not reloaded" in bad.stderr
        assert "unknown key 'engine.wrokers'" in bad.stderr
        assert httpx.get(f"{up.url}/health").status_code == 200
    status = json.loads((tmp_path / "reload.json").read_text())
    assert status["pid"] == up.proc.pid and status["reloads"] == 3 and not status["ok"]
    with sqlite3.connect(tmp_path / "ledger.db") as db:
        prices = [row[0] for row in db.execute("SELECT fresh_per_mtok FROM prices ORDER BY 1")]
    assert prices == [3.0, 5.0]  # a new price version from the reload on
    assert "DEBUG appliance.start.daemon: log level now DEBUG" in up.log.read_text()


def test_a_turn_leaves_its_request_line_in_the_log_file(tmp_path: Path) -> None:
    prompt = "Summarise the build log of this repository. " * 40  # some whole KV blocks
    with appliance_process(tmp_path, workers=1) as up:
        key = add_key(tmp_path, "alice")
        headers = {"Authorization": f"Bearer {key}", "X-Session-ID": "s1", "X-Task-ID": "t1"}
        messages = [{"role": "user", "content": prompt}]
        body = {"model": "sim", "messages": messages, "max_tokens": 4}
        for _ in range(2):  # the second turn finds the first one's prefix cached
            r = httpx.post(f"{up.url}/v1/chat/completions", headers=headers, json=body, timeout=30)
            assert r.status_code == 200, r.text
        cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0
    log = (tmp_path / "logs" / "appliance.log").read_text()
    lines = [line for line in log.splitlines() if " INFO appliance.requests: turn " in line]
    assert len(lines) == 2, log[-3000:]
    for line in lines:
        for field in ("tenant=alice", "session=s1", "task=alice/t1", "worker=w0", "status=ok"):
            assert f" {field} " in line, line
        assert re.search(r" ttft_s=\d\S* latency_s=\d+\.\d{3}$", line), line
    assert " cached_tokens=0 " in lines[0] and f" cached_tokens={cached} " in lines[1]
    assert "appliance.start.daemon: plan: worker w0 (sim) at http://127.0.0.1:" in log
    for said in ("SIGTERM: draining", "the API has drained", "workers stopped"):
        assert said in log, said
    assert log.rstrip().endswith("appliance.start.daemon: stopped")
