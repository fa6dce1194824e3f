"""Recorded traces as agent workloads: a Mooncake jsonl or an Azure csv, one task per session.

Model of the world (shared traces' README): a Mooncake line is one request with its arrival
(`timestamp`, ms), `input_length`, `output_length` and `hash_ids` (one id per 512-token
block, the same id the same tokens). The trace has no session ids; a request continues the
latest earlier request whose ids *less the last one* (a partial block) begin its own ids:
such a chain is one conversation, here one task, its requests the task's turns. A turn
appends what its input adds to the previous turn's input and output; the gap to the next
request is the wait between turns (`human`: in the conversation trace a person answers).
The first block is the prefix every request of the trace shares (block 0 in the
conversation trace), so `prefix_id` names it. An Azure line (`TIMESTAMP`, `ContextTokens`,
`GeneratedTokens`) has no prefix information: each is a one-turn task sharing nothing.
Traces record no outcomes: every task is a success that nothing verified.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from appliance.domain.errors import ConfigError
from appliance.workload.model import AgentTask, AgentTurn, TaskTree, Workload

BLOCK_TOKENS = 512
"""Tokens per Mooncake hash id."""
GAP_TOOL = "human"


@dataclass(frozen=True, slots=True)
class _TraceRequest:
    at_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]


def load_trace_workload(
    path: str | Path, *, tenant: str = "default", max_context_tokens: int = 30_000
) -> Workload:
    """Task trees in order of their first request; `max_context_tokens` ends a session early."""
    path = Path(path)
    requests = _read_azure(path) if path.suffix.lower() == ".csv" else _read_mooncake(path)
    if not requests:
        raise ConfigError(f"trace {path}: no requests in the file")
    chains = _chains(requests) if path.suffix.lower() != ".csv" else [[r] for r in requests]
    t0 = requests[0].at_s
    trees = []
    for i, chain in enumerate(chains):
        first = chain[0]
        if first.hash_ids and path.suffix.lower() != ".csv":
            prefix_id = f"trace/{first.hash_ids[0]}"
            prefix = min(BLOCK_TOKENS, first.input_tokens - 1)
        else:
            prefix_id, prefix = f"trace/{i}", 0
        turns = _turns(chain, prefix, max_context_tokens)
        task = AgentTask(
            task_id=f"t{i:06d}",
            parent_id=None,
            tenant=tenant,
            task_class="trace",
            start_s=round(first.at_s - t0, 3),
            deadline_s=None,
            succeeds=True,
            verified=False,
            prefix_id=prefix_id,
            shared_prefix_tokens=prefix,
            turns=turns,
        )
        trees.append(TaskTree(task))
    return Workload(0, tuple(trees))


def _turns(chain: list[_TraceRequest], prefix: int, max_context: int) -> tuple[AgentTurn, ...]:
    turns: list[AgentTurn] = []
    context = prefix
    for k, req in enumerate(chain):
        appended = max(1, req.input_tokens - context)
        output = max(1, req.output_tokens)
        if context + appended + output > max_context:
            if k > 0:
                break
            appended = max(1, min(appended, max_context - context - output))
            output = max(1, min(output, max_context - context - appended))
        context += appended + output
        nxt = chain[k + 1] if k + 1 < len(chain) else None
        wait_s = round(max(0.0, nxt.at_s - req.at_s), 3) if nxt else 0.0
        turns.append(AgentTurn(appended, output, GAP_TOOL if nxt else None, wait_s))
    end = turns[-1]
    if end.tool_class is not None:
        turns[-1] = AgentTurn(end.appended_tokens, end.output_tokens, None, 0.0)
    return tuple(turns)


def _chains(requests: list[_TraceRequest]) -> list[list[_TraceRequest]]:
    owner: dict[tuple[int, ...], int] = {}
    chains: list[list[_TraceRequest]] = []
    for req in requests:
        ids = req.hash_ids
        found = next((owner[ids[:n]] for n in range(len(ids), 1, -1) if ids[:n] in owner), None)
        if found is None:
            found = len(chains)
            chains.append([])
        chains[found].append(req)
        if len(ids) >= 3:
            owner[ids[:-1]] = found
    return chains


def _read_mooncake(path: Path) -> list[_TraceRequest]:
    out = []
    try:
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    out.append(
                        _TraceRequest(
                            float(row["timestamp"]) / 1000,
                            int(row["input_length"]),
                            int(row["output_length"]),
                            tuple(int(h) for h in row.get("hash_ids", ())),
                        )
                    )
                except (ValueError, KeyError, TypeError) as exc:
                    raise ConfigError(
                        f"trace {path}: line {n} is not a Mooncake request "
                        f"(timestamp, input_length, output_length, hash_ids): {exc}"
                    ) from None
    except OSError as exc:
        raise ConfigError(f"trace {path}: cannot read it ({exc.strerror or exc})") from None
    return sorted(out, key=lambda r: r.at_s)


def _read_azure(path: Path) -> list[_TraceRequest]:
    out = []
    try:
        with path.open(newline="") as f:
            for n, row in enumerate(csv.DictReader(f), 2):
                try:
                    stamp = row["TIMESTAMP"].strip()
                    head, dot, frac = stamp.partition(".")
                    at = datetime.fromisoformat(head + (dot + frac[:6] if dot else ""))
                    out.append(
                        _TraceRequest(
                            at.timestamp(),
                            int(row["ContextTokens"]),
                            int(row["GeneratedTokens"]),
                            (),
                        )
                    )
                except (ValueError, KeyError, AttributeError) as exc:
                    raise ConfigError(
                        f"trace {path}: row {n} is not an Azure request "
                        f"(TIMESTAMP, ContextTokens, GeneratedTokens): {exc}"
                    ) from None
    except OSError as exc:
        raise ConfigError(f"trace {path}: cannot read it ({exc.strerror or exc})") from None
    return sorted(out, key=lambda r: r.at_s)
