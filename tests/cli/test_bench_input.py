"""`appliance bench` with bad input: one line on stderr and the exit code, never a traceback.
(The runs against a live appliance are in tests/e2e/test_bench.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli.test_cli import run
from tests.ports import free_port


def one_line(stderr: str) -> str:
    assert stderr.count("\n") == 1, stderr
    assert "Traceback" not in stderr
    return stderr


def test_an_unreachable_url_is_exit_1(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    r = run("bench", "--url", url, "--api-key", "sk-x", "--duration", "1", data_dir=tmp_path)
    assert r.returncode == 1
    assert f"cannot reach {url}" in one_line(r.stderr)


def test_no_key_in_the_data_dir_is_exit_2(tmp_path: Path) -> None:
    r = run("bench", "--url", f"http://127.0.0.1:{free_port()}", data_dir=tmp_path)
    assert r.returncode == 2
    assert "no API key" in one_line(r.stderr) and "--api-key" in r.stderr


@pytest.mark.parametrize(
    ("yaml_text", "names"),
    [
        ("seed: 1\nturns: 3\n", "unknown key 'turns'"),
        ("task_classes:\n  - name: x\n", "task_classes[0].weight"),
        ("seed: [1\n", "not valid YAML"),
        ("tenants: []\n", "tenants"),
    ],
)
def test_a_bad_workload_file_is_exit_2_naming_the_key(
    tmp_path: Path, yaml_text: str, names: str
) -> None:
    workload = tmp_path / "workload.yaml"
    workload.write_text(yaml_text)
    r = run("bench", "--workload", str(workload), "--api-key", "sk-x", data_dir=tmp_path)
    assert r.returncode == 2
    assert names in one_line(r.stderr) and str(workload) in r.stderr


def test_a_bad_option_is_a_usage_error(tmp_path: Path) -> None:
    r = run("bench", "--concurrency", "0", data_dir=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_users_go_with_a_folder_of_recorded_sessions_only(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    r = run("bench", "--url", url, "--users", "2", "--api-key", "sk-x", data_dir=tmp_path)
    assert r.returncode == 2 and "--users N goes with --trace DIR" in one_line(r.stderr)
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    r = run("bench", "--url", url, "--trace", str(sessions), "--api-key", "sk-x", data_dir=tmp_path)
    assert r.returncode == 2 and "--users N goes with --trace DIR" in one_line(r.stderr)


def test_an_empty_folder_of_sessions_is_exit_2(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    r = run(
        "bench",
        "--url",
        url,
        "--trace",
        str(tmp_path),
        "--users",
        "2",
        "--api-key",
        "sk-x",
        data_dir=tmp_path,
    )
    assert r.returncode == 2 and "holds no session file" in one_line(r.stderr)
