"""Recorded agent sessions driven live, closed loop, against a running appliance: the replay's
run (`appliance replay DIR --users N`) over HTTP, in real seconds.

Model of the world (the replay's `session_loop.py`, kv-cache-tester's `--recycle`): `users`
users each run one recorded session after another, the list cycling; user `u` starts at
`u * warmup_s / users`. A session's requests go in order, each `think_time` (times
`time_scale`) after the previous answer ended; a sub-agent entry starts its sub-agents beside
the session, each its own session (`SID/saSTEP.I`), and the session waits for those it
waited for when recorded, then goes on after its next think time less what they took when
recorded (background ones run on, nobody waits). A request whose prompt and answer do not
fit the model's window is skipped and counted, and its session goes on; of a run of them, the
first whose prompt alone overflows the window is sent at once, as a harness sends it (the
previous prompt and the words it adds), and the box refuses it (400, counted): the replay's
`on_overflow`. Each request is one
streamed chat completion with `X-Session-ID` and no other agent header
(`workload/agent_sessions.py`: the prompts, answers and tool calls).

Stopping: at `duration_s` no new request is sent; those in flight may finish for `drain_s`
more, then their streams are closed (abandoned). A request counts when it was sent after
`warmup_s` and by `duration_s`, as the replay counts arrivals.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from appliance.bench.agents import sleep_unless_stopped
from appliance.bench.client import ApplianceClient
from appliance.bench.session_figures import LiveTurn, SessionRecorder
from appliance.workload.agent_sessions import SessionPrompts, warm_blocks
from appliance.workload.agent_traces import AgentSessionTrace, TraceRequest, TraceSubagents


@dataclass(frozen=True, slots=True)
class SessionRunPlan:
    run_tag: str
    """Prefix of every session id of this run."""
    users: int
    duration_s: float
    warmup_s: float
    drain_s: float
    time_scale: float
    max_model_len: int | None


@dataclass(slots=True)
class _Agent:
    """One session or sub-agent running."""

    sid: str
    prompts: SessionPrompts
    sent: int = 0
    credit_s: float = 0.0


class LiveSessions:
    def __init__(
        self,
        client: ApplianceClient,
        sessions: Sequence[AgentSessionTrace],
        plan: SessionRunPlan,
        rec: SessionRecorder,
    ) -> None:
        if not sessions:
            raise ValueError("no sessions to run")
        self._client = client
        self._sessions = sessions
        self._plan = plan
        self._rec = rec
        self._stop = asyncio.Event()
        self._next = 0
        self._t0 = 0.0
        self._background: set[asyncio.Task[bool]] = set()
        """Sub-agents nobody waits for: they run on after their session."""

    async def run(self) -> None:
        """Until `duration_s`, then the drain; what is still running is cancelled."""
        self._t0 = time.perf_counter()
        users = [asyncio.create_task(self._user(u)) for u in range(self._plan.users)]
        await self._wait(self._plan.duration_s)
        self._stop.set()
        running = [*users, *self._background]
        _, pending = await asyncio.wait(running, timeout=self._plan.drain_s)
        for task in pending:
            task.cancel()
        for result in await asyncio.gather(*running, return_exceptions=True):
            if isinstance(result, BaseException) and not isinstance(result, asyncio.CancelledError):
                raise result

    async def _user(self, user: int) -> None:
        if not await self._wait(user * self._plan.warmup_s / self._plan.users):
            return
        n = 0
        while not self._stop.is_set():
            trace = self._sessions[self._next % len(self._sessions)]
            self._next += 1
            n += 1
            sid = f"{self._plan.run_tag}-u{user}.{n}:{trace.session_id}"
            first = next((s for s in trace.steps if isinstance(s, TraceRequest)), None)
            warm = warm_blocks(trace.system_tokens, trace.tool_tokens)
            warm_ids = first.hash_ids[:warm] if first is not None else ()
            self._rec.sessions_started += 1
            if await self._agent(sid, trace.steps, scope=sid, warm_ids=warm_ids):
                self._rec.sessions_finished += 1

    async def _agent(
        self,
        sid: str,
        steps: Sequence[TraceRequest | TraceSubagents],
        *,
        scope: str,
        warm_ids: tuple[int, ...] = (),
    ) -> bool:
        """Run one session or sub-agent; False when the run stopped it first."""
        fits = [s for s in steps if isinstance(s, TraceRequest) and self._fits(s)]
        agent = _Agent(sid, SessionPrompts(fits, scope, warm_ids))
        overflowed = False  # this run of skipped requests has sent its overflowing one
        for k, step in enumerate(steps):  # skips are counted after the end too, as replayed
            if isinstance(step, TraceSubagents):
                if self._stop.is_set():
                    return False
                await self._subagents(agent, k, step, scope)
            elif not self._fits(step):
                self._rec.skipped_for_window += 1
                self._rec.skipped_tokens += step.input_tokens
                if not overflowed and agent.sent and self._overflows(step):
                    overflowed = True
                    await self._overflow(agent, step)
            elif not await self._request(agent, step):
                return False
            else:
                overflowed = False
        return not self._stop.is_set()

    def _fits(self, step: TraceRequest) -> bool:
        limit = self._plan.max_model_len
        return limit is None or step.fits(limit)

    def _overflows(self, step: TraceRequest) -> bool:
        limit = self._plan.max_model_len
        return limit is not None and step.overflows(limit) and not self._stop.is_set()

    async def _overflow(self, agent: _Agent, step: TraceRequest) -> None:
        """Send the request the window refuses, as its harness would (its answer: a 400)."""
        request = agent.prompts.overflowing(step)
        headers = {"X-Session-ID": agent.sid}
        result, _ = await self._client.step(
            agent.sid, request.messages, headers=headers, options=request.body()
        )
        if result.ok or not (result.error or "").startswith("400"):
            self._rec.error(f"a prompt over the window was not refused: {result.error}")
        else:
            self._rec.refused_for_window += 1

    async def _subagents(self, agent: _Agent, k: int, step: TraceSubagents, scope: str) -> None:
        waited: list[asyncio.Task[bool]] = []
        for i, sub in enumerate(step.agents):
            self._rec.subagents += 1
            child = self._agent(f"{agent.sid}/sa{k + 1}.{i}", sub.requests, scope=scope)
            task = asyncio.create_task(child)
            if sub.parent_waits:
                waited.append(task)
                agent.credit_s = max(agent.credit_s, sub.duration_s or 0.0)
            else:
                self._background.add(task)
                task.add_done_callback(self._background.discard)
        if waited:
            await asyncio.gather(*waited)

    async def _request(self, agent: _Agent, step: TraceRequest) -> bool:
        """Send the agent's next request after its think time; False when the run stopped
        first (nothing sent)."""
        think_s = max(0.0, step.think_time_s - agent.credit_s) * self._plan.time_scale
        agent.credit_s = 0.0
        if not await self._wait(think_s):
            return False
        request = agent.prompts.request(agent.sent)
        agent.sent += 1
        sent_s = time.perf_counter() - self._t0
        headers = {"X-Session-ID": agent.sid}
        try:
            result, _ = await self._client.step(
                agent.sid, request.messages, headers=headers, options=request.body()
            )
        except asyncio.CancelledError:
            self._rec.abandoned += 1
            raise
        self._rec.turns.append(
            LiveTurn(agent.sid, sent_s, request.input_tokens, request.tool_call, result)
        )
        if not result.ok:
            self._rec.error(result.error or "failed request")
        return True

    async def _wait(self, seconds: float) -> bool:
        return await sleep_unless_stopped(self._stop, seconds)
