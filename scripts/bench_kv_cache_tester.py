"""kv-cache-tester's trace_replay_tester.py, unmodified, against `appliance up --engine sim`
(server.auth: none) and against vllm-router over the same simulated workers (issue 37).

    .venv/bin/python scripts/bench_kv_cache_tester.py [--stacks appliance,vllm-router]
        [--duration 300] [--users 12] [--workers 2] [--kv-gib 24] [--max-model-len 65536]
        [--max-context 40000] [--max-delay 60] [--seed 42] [--port 18080]
        [--work /tmp/kvct-bench] [--kvct-git-dir DIR] [--setup-only | --report-only]

One command: it sets up (or checks) what the tester needs, outside this repository and its
venv, then runs each stack for `--duration` seconds and prints the figures side by side:

- the tester: kv-cache-tester (github.com/callanjfox/kv-cache-tester) at `--kvct-commit`,
  in `--kvct-dir` (taken from `--kvct-git-dir`, a clone or bare mirror, with `git archive`,
  else cloned from `--kvct-url`); its sha256 is checked against the commit's file, so the
  run uses it unmodified. Its dependencies (requirements.txt less torch: transformers only
  loads a tokenizer here) in a venv of its own, `--kvct-venv`.
- vllm-router `--vllm-router-version` (PyPI) in a venv of its own, `--vr-venv`.
- the recorded Claude Code sessions (`--traces`, the `*.json.gz` kv-cache-tester publishes),
  unpacked into `--work`/traces and checked against their SHA256SUMS (the tester reads
  `*.json` only); they are never written.
- one tokenizer for both sides (`--work`/tokenizer): the byte-level BPE the tests build
  (tests/fixtures/tiny_model.py, seed 0; nothing downloaded). The tester needs a Hugging
  Face tokenizer to size its prompts (its default, Qwen2.5-Coder, is not reachable here)
  and the simulated workers and the appliance tokenise with the same one (`engine.model`,
  with a config.json naming its vocabulary; BOS left to the chat template, as Qwen's), so
  a prompt the tester sizes at N tokens is N tokens on the server too (plus the template's
  own), and it counts each streamed token once.

Stacks (each from a cold start, fresh data dir, same ports, same tester flags and seed):

- `appliance`: `appliance up --engine sim` with `server.auth: none`, `--workers`
  simulated H200 workers (the bundled profile) with `--kv-gib` of KV each and a window of
  `--max-model-len`; the tester at the appliance's port (it sends the key `EMPTY`).
- `vllm-router`: the same workers, started from the very command lines and environments
  that `appliance up --engine sim` gives them (it is started with the same config, the
  workers' command lines are read from /proc, then it is stopped), and in front of them
  vllm-router with `--policy consistent_hash` (the tester sends `X-Session-ID`, which that
  policy hashes; `--vr-policy` to change it). No appliance runs during this stack.

The tester runs with a fixed number of users (`--start-users N --max-users N --recycle`:
a user whose session ends, or whose next request exceeds `--max-context`, is replaced by a
new session), think times from the trace (`think-only`, capped at `--max-delay`), graphs
skipped. Everything else is the tester's default (SLO: TTFT <= 5 s, decode >= 30 tok/s;
warm prefix 50 %).

Figures per stack: the tester's own end-of-test summary (requests, TTFT avg/p50/p95/max,
SLO shares, its workload cache-hit model), errors (the tester's ERROR log lines, failed
rows in detailed_results.csv, its connection errors; for the appliance also turns whose
status is not ok), the workers' own prefix-cache hit ratio and token counts over the run
(their /metrics, before and after), and the machine: load average and the CPU seconds of
the tester, the router and the workers against everything else on the box.

Everything is loopback; the script stops what it started (by process group) and leaves
its outputs in `--work`/STACK/ (tester outputs and log, server logs, figures.json) and
`--work`/summary.json. Not part of the product nor of the test suite.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gzip
import hashlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
APPLIANCE = Path(sys.executable).parent / "appliance"
KVCT_URL = "https://github.com/callanjfox/kv-cache-tester"
KVCT_COMMIT = "94f6046dfd9c0c8bc0cdb24a5aa6579bac8669bf"
KVCT_TESTER_SHA256 = "1b84c5330eca0ed2a08a64458bb569dc34c93e84e7a3411ae09f6d4e0381245b"
"""trace_replay_tester.py at KVCT_COMMIT, for a copy that has no git history beside it."""
KVCT_PACKAGES = ["openai", "transformers", "plotly", "pandas", "numpy", "requests", "aiohttp"]
GIB = 2**30


# --- setup -------------------------------------------------------------------------------


def sh(argv: list[str], **kw: Any) -> str:
    out = subprocess.run(argv, check=True, capture_output=True, text=True, **kw)
    return str(out.stdout)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def ensure_tester(args: argparse.Namespace) -> dict[str, str]:
    """kv-cache-tester at the commit, unmodified: its trace_replay_tester.py's sha256 is the
    commit's."""
    dest, commit = args.kvct_dir, args.kvct_commit
    tester = dest / "trace_replay_tester.py"
    if not tester.exists():
        dest.mkdir(parents=True, exist_ok=True)
        if args.kvct_git_dir:
            # the traces/ folder is left out: the run reads --traces (a bare mirror may
            # not even hold those blobs)
            archive = subprocess.run(
                [
                    "git",
                    "--git-dir",
                    str(args.kvct_git_dir),
                    "archive",
                    commit,
                    "--",
                    ".",
                    ":(exclude)traces",
                ],
                check=False,
                capture_output=True,
            )
            subprocess.run(["tar", "x", "-C", str(dest)], input=archive.stdout, check=True)
        else:
            sh(["git", "clone", "--quiet", args.kvct_url, str(dest)])
            sh(["git", "-C", str(dest), "checkout", "--quiet", commit])
    want = None
    git_dir = args.kvct_git_dir or (dest / ".git" if (dest / ".git").exists() else None)
    if git_dir:
        blob = subprocess.run(
            ["git", "--git-dir", str(git_dir), "show", f"{commit}:trace_replay_tester.py"],
            check=True,
            capture_output=True,
        ).stdout
        want = hashlib.sha256(blob).hexdigest()
    elif commit == KVCT_COMMIT:
        want = KVCT_TESTER_SHA256
    got = sha256(tester)
    if want is not None and got != want:
        raise SystemExit(f"{tester} differs from {commit}'s ({got} != {want}): not unmodified")
    return {
        "url": args.kvct_url,
        "commit": commit,
        "trace_replay_tester_sha256": got,
        "checked_against_commit": str(want is not None),
    }


def ensure_venv(venv: Path, packages: list[str], check: str) -> None:
    """A venv of its own with `packages`, unless `check` already runs in it."""
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0:
        return
    if not py.exists():
        sh(["python3", "-m", "venv", str(venv)])
    print(f"installing {' '.join(packages)} into {venv}", flush=True)
    subprocess.run([str(py), "-m", "pip", "install", "--quiet", *packages], check=True)
    subprocess.run([str(py), "-c", check], check=True)


def venv_version(venv: Path, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    return sh([str(venv / "bin" / "python"), "-c", code]).strip()


def ensure_traces(src: Path, dest: Path) -> int:
    """The recorded sessions unpacked to `*.json`, each checked against SHA256SUMS."""
    sums = {}
    for line in (src / "SHA256SUMS").read_text().splitlines():
        digest, name = line.split()
        sums[name] = digest
    dest.mkdir(parents=True, exist_ok=True)
    for name, digest in sums.items():
        out = dest / name
        if not out.exists():
            out.write_bytes(gzip.decompress((src / f"{name}.gz").read_bytes()))
        if sha256(out) != digest:
            raise SystemExit(f"{out}: sha256 differs from {src}/SHA256SUMS")
    return len(sums)


def ensure_tokenizer(kvct_py: Path, dest: Path, max_model_len: int) -> None:
    """tests/fixtures/tiny_model.py's byte-level BPE (seed 0) with no BOS added on encode,
    and a config.json naming its
    vocabulary (the appliance wants one in a model directory; the simulated model's shape
    and speed are the GPU profile's, Llama-3-8B on an H200, whatever the config says)."""
    if not (dest / "tokenizer.json").exists():
        code = (
            "import sys; sys.path.insert(0, sys.argv[1]);"
            "from tiny_model import TinyModelSpec, build_tokenizer;"
            "build_tokenizer(TinyModelSpec()).save_pretrained(sys.argv[2])"
        )
        subprocess.run(
            [str(kvct_py), "-c", code, str(ROOT / "tests" / "fixtures"), str(dest)],
            check=True,
            capture_output=True,
        )
    tok = json.loads((dest / "tokenizer.json").read_text())
    if tok.get("post_processor") is not None:
        # BOS is left to the chat template (`{{ bos_token }}`), as with Qwen's tokenizers:
        # the tester counts a streamed token by encoding its text, which would otherwise
        # count each token twice (BOS + token)
        tok["post_processor"] = None
        (dest / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    vocab = len(tok["model"]["vocab"]) + sum(
        1 for t in tok.get("added_tokens", []) if t["content"] not in tok["model"]["vocab"]
    )
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "max_position_embeddings": max(max_model_len, 4096),
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 3,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    }
    (dest / "config.json").write_text(json.dumps(config, indent=1))


# --- processes ---------------------------------------------------------------------------


class Procs:
    """What this script starts, each in a process group of its own, stopped on exit."""

    def __init__(self) -> None:
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.logs: dict[str, Path] = {}

    def start(
        self,
        name: str,
        argv: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> subprocess.Popen[bytes]:
        self.logs[name] = log
        with log.open("wb") as out:
            p = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
            )
        self.procs[name] = p
        return p

    def check(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None and name != "tester":
                tail = self.logs[name].read_text(errors="replace")[-3000:]
                raise SystemExit(f"{name} exited ({p.returncode}):\n{tail}")

    def stop(self, name: str, timeout_s: float = 45) -> None:
        p = self.procs.pop(name, None)
        if p is None:
            return
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def stop_all(self) -> None:
        for name in list(self.procs)[::-1]:
            self.stop(name)

    def cpu_s(self, name: str, part: str = "all") -> float:
        """CPU seconds so far of a process (`own`), its children (`children`) or both (nan
        when gone)."""
        p = self.procs.get(name)
        if p is None:
            return math.nan
        try:
            proc = psutil.Process(p.pid)
            total = sum(proc.cpu_times()[:2]) if part != "children" else 0.0
            if part != "own":
                for child in proc.children(recursive=True):
                    total += sum(child.cpu_times()[:2])
            return total
        except psutil.Error:
            return math.nan


def get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def wait_http(url: str, procs: Procs, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check()
        if get(url, timeout=1)[0] == 200:
            return
        time.sleep(0.3)
    raise SystemExit(f"{url} did not answer 200 within {timeout_s:.0f} s")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


# --- the stacks --------------------------------------------------------------------------


def appliance_config(args: argparse.Namespace, tokenizer: Path) -> str:
    return (
        "server:\n"
        "  host: 127.0.0.1\n"
        f"  port: {args.port}\n"
        "  auth: none\n"
        "engine:\n"
        f"  workers: {args.workers}\n"
        f"  model: {tokenizer}\n"
        "  served_model_name: sim\n"
        f"  kv_cache_memory_bytes: {int(args.kv_gib * GIB)}\n"
        f"  max_model_len: {args.max_model_len}\n"
    )


def start_appliance(args: argparse.Namespace, procs: Procs, out: Path, tokenizer: Path) -> str:
    """`appliance up --engine sim` on a fresh data dir; its API's URL."""
    data = out / "data"
    shutil.rmtree(data, ignore_errors=True)
    data.mkdir(parents=True)
    cfg = out / "appliance.yaml"
    cfg.write_text(appliance_config(args, tokenizer))
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    procs.start(
        "appliance",
        [str(APPLIANCE), "up", "--engine", "sim", "--config", str(cfg), "--data-dir", str(data)],
        out / "appliance.log",
        env=env,
    )
    url = f"http://127.0.0.1:{args.port}"
    wait_http(f"{url}/health", procs)
    return url


def sim_workers(procs: Procs, n: int, timeout_s: float = 60) -> list[dict[str, Any]]:
    """The simulated workers the appliance started: command line, environment, URL."""
    deadline = time.monotonic() + timeout_s
    while True:
        root = psutil.Process(procs.procs["appliance"].pid)
        found = []
        for child in root.children(recursive=True):
            try:
                argv = child.cmdline()
                if "appliance.sim.entrypoints.vllm_entry" in argv:
                    port = int(argv[argv.index("--port") + 1])
                    found.append(
                        {
                            "argv": argv,
                            "env": child.environ(),
                            "port": port,
                            "url": f"http://127.0.0.1:{port}",
                        }
                    )
            except (psutil.Error, ValueError, IndexError):
                continue
        if len(found) == n:
            return sorted(found, key=lambda w: w["port"])
        if time.monotonic() > deadline:
            raise SystemExit(f"found {len(found)} simulated workers under the appliance, not {n}")
        time.sleep(0.5)


def worker_counters(urls: list[str]) -> dict[str, float]:
    """vLLM counters summed over the workers (and over label sets), plus the KV blocks."""
    names = (
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
        "vllm:prompt_tokens",
        "vllm:generation_tokens",
        "vllm:num_preemptions",
    )
    out: dict[str, float] = {}
    for url in urls:
        status, body = get(f"{url}/metrics", timeout=5)
        if status != 200:
            continue
        for line in body.decode().splitlines():
            if line.startswith("#") or not line.strip():
                continue
            m = re.match(r"([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)", line)
            if not m:
                continue
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            base = name.removesuffix("_total")
            if base in names:
                out[base] = out.get(base, 0.0) + value
            elif base == "vllm:request_success":
                reason = re.search(r'finished_reason="([^"]+)"', labels)
                key = f"requests_{reason.group(1) if reason else 'all'}"
                out[key] = out.get(key, 0.0) + value
                out[f"requests@{url}"] = out.get(f"requests@{url}", 0.0) + value
            elif name == "vllm:cache_config_info":
                blocks = re.search(r'num_gpu_blocks="(\d+)"', labels)
                if blocks:
                    out[f"num_gpu_blocks@{url}"] = float(blocks.group(1))
    return out


class Monitor(threading.Thread):
    """Load average and CPU time while the tester runs: ours (by process) and the box's."""

    def __init__(self, parts: dict[str, Any]) -> None:
        """`parts`: a name -> a function giving its CPU seconds so far."""
        super().__init__(daemon=True)
        self.parts = parts
        self.stop_event = threading.Event()
        self.loads: list[float] = []
        self.cpu_last: dict[str, float] = {}

    def read(self) -> dict[str, float]:
        return {n: fn() for n, fn in self.parts.items()}

    def run(self) -> None:
        self.t0 = time.monotonic()
        self.box0 = psutil.cpu_times()
        self.cpu0 = self.read()
        while not self.stop_event.wait(5.0):
            self.loads.append(os.getloadavg()[0])
            for n, v in self.read().items():  # the last reading before a process ends
                if not math.isnan(v):
                    self.cpu_last[n] = v

    def finish(self) -> dict[str, Any]:
        self.stop_event.set()
        self.join()
        wall = time.monotonic() - self.t0
        box1 = psutil.cpu_times()
        busy = (
            sum(box1)
            - box1.idle
            - box1.iowait
            - (sum(self.box0) - self.box0.idle - self.box0.iowait)
        )
        ours = {n: self.cpu_last.get(n, math.nan) - self.cpu0[n] for n in self.parts}
        ours_total = sum(v for v in ours.values() if not math.isnan(v))
        cores = psutil.cpu_count() or 1
        return {
            "wall_s": round(wall, 1),
            "cores": cores,
            "load1_mean": round(sum(self.loads) / len(self.loads), 2) if self.loads else None,
            "load1_max": round(max(self.loads), 2) if self.loads else None,
            "box_busy_share": round(busy / (wall * cores), 3),
            "cpu_s": {n: round(v, 1) for n, v in ours.items()},
            "other_cpu_s": round(busy - ours_total, 1),
        }


def run_tester(
    args: argparse.Namespace,
    procs: Procs,
    url: str,
    out: Path,
    tokenizer: Path,
    watch: dict[str, Any],
) -> tuple[int, dict[str, Any]]:
    """trace_replay_tester.py, unmodified, against `url` for --duration seconds."""
    tdir = out / "tester"
    shutil.rmtree(tdir, ignore_errors=True)
    argv = [
        str(args.kvct_venv / "bin" / "python"),
        str(args.kvct_dir / "trace_replay_tester.py"),
        "--api-endpoint",
        url,
        "--trace-directory",
        str(args.work / "traces"),
        "--output-dir",
        str(tdir),
        "--tokenizer",
        str(tokenizer),
        "--start-users",
        str(args.users),
        "--max-users",
        str(args.users),
        "--recycle",
        "--test-duration",
        str(args.duration),
        "--max-context",
        str(args.max_context),
        "--max-delay",
        str(args.max_delay),
        "--timing-strategy",
        "think-only",
        "--seed",
        str(args.seed),
        "--skip-graphs",
        "--no-color",
    ]
    (out / "tester_argv.json").write_text(json.dumps(argv, indent=1))
    print(f"  tester: {' '.join(argv[1:])}", flush=True)
    p = procs.start("tester", argv, out / "tester.log", cwd=out)
    mon = Monitor({"tester": lambda: procs.cpu_s("tester"), **watch})
    mon.start()
    deadline = time.monotonic() + args.duration + 600  # loading, pools, draining, CSVs
    while p.poll() is None:
        if time.monotonic() > deadline:
            print("  tester overran its deadline; stopped", flush=True)
            break
        try:
            procs.check()
        except SystemExit:
            mon.finish()
            raise
        time.sleep(2)
    machine = mon.finish()
    procs.stop("tester", timeout_s=30)
    return (p.returncode if p.returncode is not None else -1), machine


def tester_figures(out: Path) -> dict[str, Any]:
    """The tester's end-of-test summary, errors, and TTFTs recomputed from its CSV."""
    whole = (out / "tester.log").read_text(errors="replace")
    # the end-of-test summary (the per-period lines before it use some of the same words)
    log = whole.rsplit("Test Complete", 1)[-1] if "Test Complete" in whole else ""
    f: dict[str, Any] = {"summary_found": bool(log)}
    pats = {
        "duration_s": r"Duration: ([\d.]+)s",
        "requests": r"Total Requests: (\d+)",
        "users_created": r"Total Users Created: (\d+)",
        "connection_errors": r"Connection Errors: (\d+)",
        "workload_cache_hit": r"Avg Workload Cache Hit Rate: ([\d.]+%)",
        "throughput": r"Throughput: (.+tok/s)",
    }
    for key, pat in pats.items():
        m = re.search(pat, log)
        f[key] = m.group(1) if m else None
    m = re.search(r"TTFT avg/p50/p95/max: ([\d.]+)s / ([\d.]+)s / ([\d.]+)s / ([\d.]+)s", log)
    if m:
        f["ttft_avg_p50_p95_max_s"] = [float(x) for x in m.groups()]
    for key, label in (
        ("slo_ttft_met", "TTFT met:"),
        ("slo_decode_met", "Decode met:"),
        ("goodput", "Goodput (both):"),
        ("effective_ttft_met", "Effective TTFT met:"),
    ):
        m = re.search(re.escape(label) + r"\s+(\d+/\d+ \([\d.]+%\))", log)
        f[key] = m.group(1) if m else None
    m = re.search(r"SLO Compliance \((.+?)\)", log)
    f["slo"] = m.group(1) if m else None
    f["error_lines"] = [ln for ln in whole.splitlines() if " ERROR - " in ln][:20]
    f["error_line_count"] = sum(1 for ln in whole.splitlines() if " ERROR - " in ln)
    f["warning_line_count"] = sum(1 for ln in whole.splitlines() if " WARNING - " in ln)
    f["stopped_at_max_context"] = whole.count("exceeds --max-context")
    f["zero_output_fallbacks"] = whole.count("injecting fallback")
    rows_path = out / "tester" / "detailed_results.csv"
    if rows_path.exists():
        with rows_path.open() as fh:
            rows = list(csv.DictReader(fh))
        ok = [r for r in rows if r["success"] == "True"]
        f["csv_rows"] = len(rows)
        f["csv_failed"] = len(rows) - len(ok)
        ttfts = sorted(float(r["ttft"]) for r in ok)
        if ttfts:
            f["csv_ttft_p50_p95_s"] = [round(pct(ttfts, 0.5), 3), round(pct(ttfts, 0.95), 3)]
        f["csv_input_tokens"] = sum(int(r["input_tokens"]) for r in rows)
        f["csv_output_tokens"] = sum(int(float(r["output_tokens_actual"])) for r in rows)
    return f


def pct(values: list[float], q: float) -> float:
    """numpy's default (linear) percentile of sorted values, as the tester reports."""
    if not values:
        return math.nan
    k = (len(values) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def appliance_turns(log: Path) -> dict[str, int]:
    """Turn lines of the appliance's log by status."""
    counts: dict[str, int] = {}
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r"appliance\.requests: turn .* status=(\S+)", line)
        if m:
            counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


def counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    d: dict[str, Any] = {k: after[k] - before.get(k, 0.0) for k in after if "@" not in k}
    q, h = d.get("vllm:prefix_cache_queries", 0.0), d.get("vllm:prefix_cache_hits", 0.0)
    d["prefix_cache_hit_ratio"] = round(h / q, 4) if q else None
    d["num_gpu_blocks"] = [v for k, v in sorted(after.items()) if k.startswith("num_gpu_blocks@")]
    d["requests_by_worker"] = [
        v - before.get(k, 0.0) for k, v in sorted(after.items()) if k.startswith("requests@")
    ]
    return d


def run_appliance(args: argparse.Namespace, procs: Procs, tokenizer: Path) -> dict[str, Any]:
    out = args.work / "appliance"
    out.mkdir(parents=True, exist_ok=True)
    url = start_appliance(args, procs, out, tokenizer)
    workers = sim_workers(procs, args.workers)
    urls = [w["url"] for w in workers]
    for u in urls:
        wait_http(f"{u}/health", procs)
    (out / "workers.json").write_text(json.dumps([w["argv"] for w in workers], indent=1))
    before = worker_counters(urls)
    watch = {
        "appliance": lambda: procs.cpu_s("appliance", "own"),
        "workers": lambda: procs.cpu_s("appliance", "children"),
    }
    rc, machine = run_tester(args, procs, url, out, tokenizer, watch)
    after = worker_counters(urls)
    procs.stop("appliance")
    figures = {
        "stack": "appliance",
        "url": url,
        "workers": urls,
        "tester_rc": rc,
        "machine": machine,
        "tester": tester_figures(out),
        "worker_counters": counters_delta(before, after),
        "appliance_turns": appliance_turns(out / "appliance.log"),
    }
    (out / "figures.json").write_text(json.dumps(figures, indent=1))
    return figures


def run_vllm_router(args: argparse.Namespace, procs: Procs, tokenizer: Path) -> dict[str, Any]:
    out = args.work / "vllm-router"
    out.mkdir(parents=True, exist_ok=True)
    # The workers exactly as `appliance up --engine sim` starts them: read, then restarted
    # on their own (cold) with no appliance in front.
    start_appliance(args, procs, out, tokenizer)
    workers = sim_workers(procs, args.workers)
    procs.stop("appliance")
    (out / "workers.json").write_text(json.dumps([w["argv"] for w in workers], indent=1))
    for i, w in enumerate(workers):
        deadline = time.monotonic() + 30
        while not port_free(w["port"]) and time.monotonic() < deadline:
            time.sleep(0.5)
        procs.start(f"worker{i}", w["argv"], out / f"worker{i}.log", env=w["env"])
    urls = [w["url"] for w in workers]
    for u in urls:
        wait_http(f"{u}/health", procs)
    vr_port = args.port + 1
    vr = args.vr_venv / "bin" / "vllm-router"
    procs.start(
        "vllm-router",
        [
            str(vr),
            "--worker-urls",
            *urls,
            "--host",
            "127.0.0.1",
            "--port",
            str(vr_port),
            "--policy",
            args.vr_policy,
            "--prometheus-port",
            str(args.port + 2),
            "--log-level",
            "warning",
        ],
        out / "vllm-router.log",
    )
    url = f"http://127.0.0.1:{vr_port}"
    wait_http(f"{url}/health", procs)
    before = worker_counters(urls)
    names = [f"worker{i}" for i in range(len(workers))]
    watch = {
        "vllm-router": lambda: procs.cpu_s("vllm-router"),
        "workers": lambda: sum(procs.cpu_s(n) for n in names),
    }
    rc, machine = run_tester(args, procs, url, out, tokenizer, watch)
    after = worker_counters(urls)
    procs.stop("vllm-router")
    for i in range(len(workers)):
        procs.stop(f"worker{i}")
    figures = {
        "stack": "vllm-router",
        "url": url,
        "workers": urls,
        "tester_rc": rc,
        "policy": args.vr_policy,
        "machine": machine,
        "tester": tester_figures(out),
        "worker_counters": counters_delta(before, after),
    }
    (out / "figures.json").write_text(json.dumps(figures, indent=1))
    return figures


# --- report ------------------------------------------------------------------------------


def table(results: list[dict[str, Any]]) -> str:
    def row(label: str, fn: Any) -> str:
        cells = []
        for r in results:
            try:
                v = fn(r)
            except (KeyError, TypeError, IndexError):
                v = None
            cells.append("-" if v is None else str(v))
        return f"| {label} | " + " | ".join(cells) + " |"

    t = lambda r: r["tester"]  # noqa: E731
    w = lambda r: r["worker_counters"]  # noqa: E731
    m = lambda r: r["machine"]  # noqa: E731
    lines = [
        "| | " + " | ".join(r["stack"] for r in results) + " |",
        "|---|" + "---|" * len(results),
        row("requests completed (tester)", lambda r: t(r)["requests"]),
        row(
            "failed requests (CSV) / ERROR lines / connection errors",
            lambda r: (
                f"{t(r)['csv_failed']} / {t(r)['error_line_count']} / "
                f"{t(r)['connection_errors'] or 0}"
            ),
        ),
        row(
            "TTFT avg / p50 / p95 / max (s)",
            lambda r: " / ".join(f"{x:.2f}" for x in t(r)["ttft_avg_p50_p95_max_s"]),
        ),
        row("TTFT met (<= 5 s)", lambda r: t(r)["slo_ttft_met"]),
        row("goodput (TTFT and decode SLO)", lambda r: t(r)["goodput"]),
        row("tester's workload cache-hit model", lambda r: t(r)["workload_cache_hit"]),
        row("workers' prefix-cache hit ratio", lambda r: f"{w(r)['prefix_cache_hit_ratio']:.3f}"),
        row(
            "prompt / generated tokens at the workers",
            lambda r: f"{w(r)['vllm:prompt_tokens']:,.0f} / {w(r)['vllm:generation_tokens']:,.0f}",
        ),
        row("throughput (tester)", lambda r: t(r)["throughput"].replace(" | ", ", ")),
        row("users created (recycled)", lambda r: t(r)["users_created"]),
        row(
            "requests by worker",
            lambda r: " / ".join(f"{v:.0f}" for v in w(r)["requests_by_worker"]),
        ),
        row("appliance turns by status", lambda r: r.get("appliance_turns")),
        row("load avg (1 min) mean / max", lambda r: f"{m(r)['load1_mean']} / {m(r)['load1_max']}"),
        row("box busy (share of all cores)", lambda r: m(r)["box_busy_share"]),
        row(
            "CPU s: tester / router / workers / everything else on the box",
            lambda r: " / ".join(
                f"{v:.0f}" for v in (*m(r)["cpu_s"].values(), m(r)["other_cpu_s"])
            ),
        ),
    ]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stacks", default="appliance,vllm-router")
    p.add_argument("--duration", type=int, default=300, help="Tester's --test-duration (s).")
    p.add_argument("--users", type=int, default=12, help="Concurrent users (fixed).")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--kv-gib", type=float, default=24.0, help="KV per worker (GiB).")
    p.add_argument("--max-model-len", type=int, default=65536)
    p.add_argument(
        "--max-context",
        type=int,
        default=40000,
        help="Tester's --max-context; leave room for the longest answer "
        "(18,195 tokens in these sessions) under --max-model-len.",
    )
    p.add_argument("--max-delay", type=float, default=60.0, help="Tester's --max-delay (s).")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument(
        "--port",
        type=int,
        default=18080,
        help="Appliance API; vllm-router +1, its metrics +2; workers follow.",
    )
    p.add_argument("--vr-policy", default="consistent_hash")
    p.add_argument("--work", type=Path, default=Path("/tmp/kvct-bench"))
    p.add_argument(
        "--traces", type=Path, default=ROOT.parent / "shared" / "traces" / "claude_code_kvct"
    )
    p.add_argument("--kvct-dir", type=Path, default=Path("/tmp/kvct-src"))
    p.add_argument(
        "--kvct-git-dir",
        type=Path,
        default=None,
        help="A clone or bare mirror of kv-cache-tester (else --kvct-url).",
    )
    p.add_argument("--kvct-url", default=KVCT_URL)
    p.add_argument("--kvct-commit", default=KVCT_COMMIT)
    p.add_argument("--kvct-venv", type=Path, default=Path("/tmp/kvct-venv"))
    p.add_argument("--vr-venv", type=Path, default=Path("/tmp/vr-venv"))
    p.add_argument("--vllm-router-version", default="0.1.17")
    p.add_argument("--setup-only", action="store_true")
    p.add_argument(
        "--report-only",
        action="store_true",
        help="Print the table again from the outputs already in --work (no run).",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    stacks = [s for s in args.stacks.split(",") if s]
    if args.report_only:
        results = []
        for stack in stacks:
            figures = json.loads((args.work / stack / "figures.json").read_text())
            figures["tester"] = tester_figures(args.work / stack)
            results.append(figures)
        print(table(results))
        return
    tester = ensure_tester(args)
    ensure_venv(
        args.kvct_venv, KVCT_PACKAGES, "import openai, transformers, plotly, pandas, numpy, aiohttp"
    )
    if "vllm-router" in stacks:
        ensure_venv(
            args.vr_venv,
            [f"vllm-router=={args.vllm_router_version}"],
            "import importlib.metadata as m; "
            f"assert m.version('vllm-router') == {args.vllm_router_version!r}",
        )
    n_traces = ensure_traces(args.traces, args.work / "traces")
    tokenizer = args.work / "tokenizer"
    ensure_tokenizer(args.kvct_venv / "bin" / "python", tokenizer, args.max_model_len)
    setup = {
        "kv_cache_tester": tester,
        "traces": f"{n_traces} sessions from {args.traces}",
        "tester_packages": {
            d: venv_version(args.kvct_venv, d)
            for d in ("openai", "transformers", "tokenizers", "pandas")
        },
        "vllm_router": (
            venv_version(args.vr_venv, "vllm-router") if "vllm-router" in stacks else None
        ),
        "appliance_commit": sh(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]).strip(),
        "appliance_uncommitted_paths": len(
            sh(["git", "-C", str(ROOT), "status", "--porcelain"]).splitlines()
        ),
        "appliance_config": appliance_config(args, tokenizer),
        "args": {k: str(v) for k, v in vars(args).items()},
        "load_before": os.getloadavg(),
    }
    print(json.dumps(setup, indent=1), flush=True)
    if args.setup_only:
        return
    for port in (args.port, args.port + 1, args.port + 2):
        if not port_free(port):
            raise SystemExit(f"port {port} is taken: pass --port")
    procs = Procs()
    results = []
    runners = {"appliance": run_appliance, "vllm-router": run_vllm_router}
    try:
        for stack in stacks:
            print(f"== {stack}: {args.users} users, {args.duration} s", flush=True)
            results.append(runners[stack](args, procs, tokenizer))
            print(json.dumps(results[-1]["tester"], indent=1), flush=True)
    finally:
        procs.stop_all()
    summary = {"setup": setup, "results": results}
    (args.work / "summary.json").write_text(json.dumps(summary, indent=1))
    print(table(results))
    print(f"outputs in {args.work}")


if __name__ == "__main__":
    main()
