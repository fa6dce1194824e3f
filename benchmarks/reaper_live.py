"""The idle reaper against vLLM's LRU, live: `appliance bench` against `appliance up`.

    PYTHONPATH=. .venv/bin/python benchmarks/reaper_live.py --engine vllm|sim
        [--workload configs/workload-reaper.yaml] [--duration 90] [--concurrency 16]
        [--seed N] [--time-scale 1] [--drain 30] [--kv-tokens 6144] [--host-tokens N]
        [--max-model-len 4096] [--policies reaper,lru] [--rounds 1] [--out FILE.json]
        [--keep DIR] [--model-cache DIR]

One run starts `appliance up --engine ENGINE` on one worker once per policy and round:
`reaper` (`residency.reaper` true) and `lru` (false: the workers keep their retention
connectors and nothing asks them to hold anything, so the engine's own LRU decides), the
order alternating from round to round (reaper first in odd rounds), each time with a fresh
data dir, the same KV pool (`--kv-tokens`: vLLM's CPU build at the tiny model's 1 KiB per
token, the simulated H200 at the bundled profile's 128 KiB per token) and the same
workload and seed, and runs `appliance bench` against it. Both engines serve the test
suite's tiny random-weight model (`tests/fixtures/tiny_model.py`, built into
`--model-cache`; the simulated engine takes its tokenizer). `--host-tokens` gives each
simulated worker a host tier of that many tokens (`engine.kv_host_bytes`).

The table, a column per run: the share of prompt tokens served from cache (and by task
class, from the ledger's turns), the step TTFT p50/p95 (the benchmark's client: request
sent to first token), turns done, failed and rejected, tasks finished, the worker's
preemptions (`vllm:num_preemptions_total`), its host-tier hits, the CPU seconds of the
appliance and of its workers during the bench and how busy both cores were (other work
shares this machine), and the live sessions' KV against the pool: per moment of the run,
the sum over the sessions whose task is open and that have had a turn of their context (the
last turn's prompt and output tokens), from the ledger's turns; its time average and peak.
Then the reaper's decisions (the ledger's `residency_events`) and the means over the
rounds. The reaper wins a figure when its mean cached share is higher, or its mean TTFT p95
lower, than lru's.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from appliance.config.keystore import add_key, keys_path  # noqa: E402
from appliance.engines.clients.metrics import cache_config, load_snapshot  # noqa: E402
from appliance.workload import load_spec  # noqa: E402
from tests.ports import free_port, free_port_block  # noqa: E402
from tests.vllm_server import ensure_tiny_model, resolve_vllm_python  # noqa: E402

BIN = Path(sys.executable).parent
WORKLOAD = ROOT / "configs" / "workload-reaper.yaml"
KV_BYTES_PER_TOKEN = {"vllm": 1024, "sim": 131_072}
"""The tiny model's (2 layers x 2 KV heads x 64 x K,V x bf16) and the bundled H200
profile's (Llama-3-8B)."""
MAX_MODEL_LEN = 4096
"""The tiny model's own limit (vLLM refuses more); the simulated engine takes up to 32,768."""
STARTUP_S = 240.0


@dataclass(frozen=True)
class Setup:
    engine: str
    workload: Path
    duration_s: float
    concurrency: int
    seed: int | None
    time_scale: float
    drain_s: float
    kv_tokens: int
    host_tokens: int
    max_model_len: int
    model_dir: Path
    python: str


@dataclass
class Up:
    url: str
    worker_url: str
    data_dir: Path
    proc: subprocess.Popen[bytes]


def appliance_env(setup: Setup, policy: str, data_dir: Path) -> dict[str, str]:
    per_token = KV_BYTES_PER_TOKEN[setup.engine]
    env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    env.update(
        APPLIANCE_DATA_DIR=str(data_dir),
        APPLIANCE_RESIDENCY__REAPER="true" if policy == "reaper" else "false",
        APPLIANCE_ENGINE__MODEL=str(setup.model_dir),
        APPLIANCE_ENGINE__MAX_MODEL_LEN=str(setup.max_model_len),
        APPLIANCE_ENGINE__KV_CACHE_MEMORY_BYTES=str(setup.kv_tokens * per_token),
        APPLIANCE_ENGINE__BASE_PORT=str(free_port_block(1)),
        APPLIANCE_ENGINE__KV_EVENTS_BASE_PORT=str(free_port_block(1)),
        APPLIANCE_ENGINE__KV_RETENTION_BASE_PORT=str(free_port_block(1)),
    )
    if setup.engine == "vllm":
        env["APPLIANCE_ENGINE__PYTHON"] = setup.python
    if setup.host_tokens:
        env["APPLIANCE_ENGINE__KV_HOST_BYTES"] = str(setup.host_tokens * per_token)
    return env


@contextmanager
def appliance_up(setup: Setup, policy: str, data_dir: Path) -> Iterator[Up]:
    """`appliance up` on one worker until the block ends (SIGTERM, as Ctrl-C)."""
    env = appliance_env(setup, policy, data_dir)
    port = free_port()
    argv = [str(BIN / "appliance"), "up", "--engine", setup.engine, "--workers", "1"]
    with (data_dir / "up.log").open("wb") as log:
        proc = subprocess.Popen(
            [*argv, "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + STARTUP_S
    try:
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (data_dir / "up.log").read_text()[-3000:]
                raise SystemExit(f"appliance up did not become healthy:\n{tail}")
            time.sleep(0.3)
        worker = f"http://127.0.0.1:{env['APPLIANCE_ENGINE__BASE_PORT']}"
        yield Up(url, worker, data_dir, proc)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            proc.kill()


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def bench(setup: Setup, up: Up) -> dict[str, Any]:
    report = up.data_dir / "bench.json"
    argv = [str(BIN / "appliance"), "bench", "--url", up.url, "--data-dir", str(up.data_dir)]
    argv += ["--workload", str(setup.workload), "--duration", f"{setup.duration_s:g}"]
    argv += ["--concurrency", str(setup.concurrency), "--time-scale", f"{setup.time_scale:g}"]
    argv += ["--drain", f"{setup.drain_s:g}", "--report", str(report)]
    if setup.seed is not None:
        argv += ["--seed", str(setup.seed)]
    timeout = setup.duration_s + setup.drain_s + 300
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"appliance bench failed ({done.returncode}):\n{done.stderr[-3000:]}")
    print(done.stdout, flush=True)
    result: dict[str, Any] = json.loads(report.read_text())
    return result


def worker_figures(up: Up) -> dict[str, Any]:
    text = httpx.get(f"{up.worker_url}/metrics", timeout=30).text
    snap = load_snapshot(text, now=0.0)
    config = cache_config(text)
    blocks = int(config.get("num_gpu_blocks", 0))
    block_size = int(config.get("block_size", 0))
    return {
        "preemptions": snap.preemptions,
        "pool_blocks": blocks,
        "block_size": block_size,
        "pool_tokens": blocks * block_size,
        "prefix_cache_hit_share": round(
            snap.prefix_cache_hits_tokens / max(snap.prefix_cache_queries_tokens, 1), 4
        ),
        "cached_by_source": snap.prompt_tokens_cached_by_source,
    }


def cpu_seconds(up: Up) -> dict[str, float]:
    """CPU time of the appliance's own process and of its workers (children), so far."""
    me = psutil.Process(up.proc.pid)
    kids = me.children(recursive=True)

    def used(p: psutil.Process) -> float:
        try:
            t = p.cpu_times()
        except psutil.Error:
            return 0.0
        return float(t.user + t.system)

    return {"appliance": round(used(me), 1), "workers": round(sum(used(k) for k in kids), 1)}


def live_kv(ledger: Path, started_at: float, finished_at: float) -> dict[str, float]:
    """The live sessions' KV over the run (see the module): time average and peak, tokens."""
    with closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        turns = db.execute(
            "SELECT t.tenant, t.session_id, t.started_at, t.prompt_tokens + t.output_tokens,"
            " k.finished_at FROM turns t LEFT JOIN tasks k ON k.task_id = t.task_id"
            " WHERE t.outcome = 'ok' ORDER BY t.started_at"
        ).fetchall()
    changes: list[tuple[float, tuple[str, str], int]] = []
    for tenant, session, at, tokens, closed in turns:
        changes.append((at, (tenant, session), tokens))
        if closed is not None:
            changes.append((closed, (tenant, session), 0))
    changes.sort(key=lambda c: c[0])
    context: dict[tuple[str, str], int] = {}
    total = peak = 0
    area, last = 0.0, started_at
    for at, key, tokens in changes:
        if at > started_at:
            span = min(at, finished_at) - last
            area += max(span, 0.0) * total
            last = max(last, min(at, finished_at))
        total += tokens - context.get(key, 0)
        context[key] = tokens
        peak = max(peak, total) if at <= finished_at else peak
    area += max(finished_at - last, 0.0) * total
    mean = area / max(finished_at - started_at, 1e-9)
    return {"mean_tokens": round(mean), "peak_tokens": peak}


def class_shares(ledger: Path) -> dict[str, float]:
    """Cached share of prompt tokens by task class (the ledger's turns)."""
    with closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT k.task_class, SUM(t.cached_tokens), SUM(t.prompt_tokens) FROM turns t"
            " JOIN tasks k ON k.task_id = t.task_id WHERE t.outcome = 'ok' GROUP BY 1"
        ).fetchall()
    return {str(c): round(cached / max(prompt, 1), 4) for c, cached, prompt in rows}


def residency_actions(ledger: Path) -> dict[str, int]:
    with closing(sqlite3.connect(f"file:{ledger}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT action, COUNT(*) FROM residency_events GROUP BY action")
        return dict(Counter({a: n for a, n in rows}))


def one_run(setup: Setup, policy: str, data_dir: Path) -> dict[str, Any]:
    data_dir.mkdir(parents=True, exist_ok=True)
    for tenant in load_spec(setup.workload).tenants:
        add_key(keys_path(data_dir), tenant.name)
    started = time.monotonic()
    with appliance_up(setup, policy, data_dir) as up:
        print(f"{policy}: appliance up in {time.monotonic() - started:.1f} s", flush=True)
        cpu0, busy0 = cpu_seconds(up), psutil.cpu_times()
        report = bench(setup, up)
        cpu1, busy1 = cpu_seconds(up), psutil.cpu_times()
        worker = worker_figures(up)
    idle = (busy1.idle - busy0.idle) / max(sum(busy1) - sum(busy0), 1e-9)
    ledger = data_dir / "ledger.db"  # the appliance has stopped: every row is in
    kv = live_kv(ledger, report["started_at"], report["finished_at"])
    return {
        "policy": policy,
        "bench": report,
        "worker": worker,
        "live_kv": kv,
        "residency_events": residency_actions(ledger),
        "cached_share_by_class": class_shares(ledger),
        "cpu_s": {k: round(cpu1[k] - cpu0[k], 1) for k in cpu0},
        "machine_busy": round(1 - idle, 2),
    }


def _share(run: dict[str, Any]) -> float:
    return float(run["bench"]["tokens"]["cached_share"])


def _ttft(run: dict[str, Any], q: str) -> float:
    return float(run["bench"]["step_latency_s"]["ttft"].get(q, math.nan))


def _decisions(run: dict[str, Any]) -> str:
    return ", ".join(f"{a} {n}" for a, n in sorted(run["residency_events"].items())) or "-"


FIGURES: dict[str, Callable[[dict[str, Any]], str]] = {
    "cached share of prompt tokens": lambda r: f"{100 * _share(r):.1f} %",
    "  of which tools / approvals": lambda r: " / ".join(
        f"{100 * r['cached_share_by_class'].get(c, 0.0):.1f}" for c in ("tools", "approvals")
    ),
    "step TTFT p50 s": lambda r: f"{_ttft(r, 'p50'):.3f}",
    "step TTFT p95 s": lambda r: f"{_ttft(r, 'p95'):.3f}",
    "turns ok": lambda r: str(r["bench"]["steps"]["ok"]),
    "turns failed / rejected": lambda r: "{failed} / {rejected}".format(**r["bench"]["steps"]),
    "tasks finished": lambda r: str(r["bench"]["tasks"]["finished"]),
    "preemptions": lambda r: str(r["worker"]["preemptions"]),
    "host-tier cached tokens": lambda r: f"{r['worker']['cached_by_source'].get('host', 0):,}",
    "CPU s: appliance / workers": lambda r: "{appliance} / {workers}".format(**r["cpu_s"]),
    "machine busy (both cores)": lambda r: f"{100 * r['machine_busy']:.0f} %",
    "live sessions' KV mean / peak": lambda r: "{mean_tokens:,} / {peak_tokens:,}".format(
        **r["live_kv"]
    ),
}


def verdict(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Means over the rounds, and whether the reaper's are better; rounds it was ahead in."""
    by = {p: [r for r in runs if r["policy"] == p] for p in ("reaper", "lru")}
    if not by["reaper"] or not by["lru"]:
        return {}
    mean = {
        p: {
            "cached_share": statistics.fmean(_share(r) for r in rs),
            "ttft_p50": statistics.fmean(_ttft(r, "p50") for r in rs),
            "ttft_p95": statistics.fmean(_ttft(r, "p95") for r in rs),
        }
        for p, rs in by.items()
    }
    pairs = list(zip(by["reaper"], by["lru"], strict=False))
    return {
        "mean": mean,
        "cached_share": mean["reaper"]["cached_share"] > mean["lru"]["cached_share"],
        "ttft_p95": mean["reaper"]["ttft_p95"] < mean["lru"]["ttft_p95"],
        "rounds": len(pairs),
        "rounds_cached_share": sum(_share(a) > _share(b) for a, b in pairs),
        "rounds_ttft_p95": sum(_ttft(a, "p95") < _ttft(b, "p95") for a, b in pairs),
    }


def render(setup: Setup, runs: list[dict[str, Any]]) -> str:
    first = runs[0]["worker"]
    lines = [
        f"engine {setup.engine}, one worker: pool {first['pool_tokens']:,} tokens "
        f"({first['pool_blocks']} blocks of {first['block_size']})"
        + (f", host tier {setup.host_tokens:,} tokens" if setup.host_tokens else "")
        + f"; workload {setup.workload.name}, seed {setup.seed}, {setup.concurrency} "
        f"concurrent tasks, {setup.duration_s:g} s, time scale {setup.time_scale:g}",
    ]
    table = [("", [f"{r['policy']} #{r['round']}" for r in runs])]
    table += [(name, [f(r) for r in runs]) for name, f in FIGURES.items()]
    widths = [max(len(t[0]) for t in table)] + [
        max(len(t[1][i]) for t in table) for i in range(len(runs))
    ]
    for name, cells in table:
        right = [c.rjust(w) for c, w in zip(cells, widths[1:], strict=True)]
        lines.append("  ".join([name.ljust(widths[0]), *right]))
    lines += [f"residency decisions, {r['policy']} #{r['round']}: {_decisions(r)}" for r in runs]
    won = verdict(runs)
    if won:
        m = won["mean"]
        lines.append(
            "mean over rounds, reaper / lru: cached share "
            f"{100 * m['reaper']['cached_share']:.1f} / {100 * m['lru']['cached_share']:.1f} %, "
            f"TTFT p50 {m['reaper']['ttft_p50']:.3f} / {m['lru']['ttft_p50']:.3f} s, "
            f"p95 {m['reaper']['ttft_p95']:.3f} / {m['lru']['ttft_p95']:.3f} s"
        )
        lines.append(
            f"reaper wins: cached share {'yes' if won['cached_share'] else 'no'} "
            f"(ahead in {won['rounds_cached_share']} of {won['rounds']} rounds), TTFT p95 "
            f"{'yes' if won['ttft_p95'] else 'no'} (ahead in {won['rounds_ttft_p95']})"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=["vllm", "sim"], required=True)
    p.add_argument("--workload", type=Path, default=WORKLOAD)
    p.add_argument("--duration", type=float, default=90.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--drain", type=float, default=30.0)
    p.add_argument("--kv-tokens", type=int, default=6144, help="KV pool per worker, tokens")
    p.add_argument("--host-tokens", type=int, default=0, help="host tier per worker (sim)")
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    p.add_argument("--policies", default="reaper,lru")
    p.add_argument("--rounds", type=int, default=1, help="rounds of both policies, in turn first")
    p.add_argument("--out", type=Path, default=None, help="write the JSON of both runs here")
    p.add_argument("--keep", type=Path, default=None, help="keep the data dirs under DIR")
    p.add_argument("--model-cache", type=Path, default=Path(tempfile.gettempdir()) / "tiny-models")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    python = resolve_vllm_python()
    setup = Setup(
        engine=args.engine,
        workload=args.workload.resolve(),
        duration_s=args.duration,
        concurrency=args.concurrency,
        seed=args.seed if args.seed is not None else load_spec(args.workload).seed,
        time_scale=args.time_scale,
        drain_s=args.drain,
        kv_tokens=args.kv_tokens,
        host_tokens=args.host_tokens,
        max_model_len=args.max_model_len,
        model_dir=ensure_tiny_model(python, args.model_cache),
        python=python,
    )
    root = args.keep or Path(tempfile.mkdtemp(prefix="reaper-live-"))
    policies = args.policies.split(",")
    runs = []
    for n in range(1, args.rounds + 1):  # the order alternates: the machine's load drifts
        for policy in policies if n % 2 else policies[::-1]:
            runs.append({**one_run(setup, policy, root / f"{policy}-{n}"), "round": n})
    print(render(setup, runs))
    if args.out is not None:
        doc = {"setup": {k: str(v) for k, v in vars(setup).items()}, "runs": runs}
        doc["reaper_wins"] = verdict(runs)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
