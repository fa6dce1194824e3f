"""Recorded agent sessions replayed closed loop: `users` at once, each running one recorded
session after another, in the replay's virtual time.

Model of the world (kv-cache-tester's `trace_replay_tester.py`, its default `think-only`
timing, with `--recycle`): a user runs a session's requests in order, each sent
`think_time` after the previous answer ended (the tool's run, or the person's reply); when
its session has no request left, the user starts the next session of the list at once.
By default every session of the list starts once (one pass: at every count of users the
same sessions are replayed, so runs differ only in how many run at once), and the counted
window ends as the last one starts (after that, fewer than `users` run); with a
`duration_s` the list cycles until then. A pass starts at least `PASS_STARTS_PER_USER`
sessions per user, the list cycled where it is shorter: a list not much longer than the
users would end the window as it begins (with as many sessions as users, every one starts
within the warm-up and nothing counts). Past the window's end nothing new is sent and what
is in flight finishes: the rest of the sessions would count for nothing (at 160 users the
tail of the longest sessions is a quarter of a pass's work). User `u` starts at
`u * warmup_s / users`, so the users ramp up over the warm-up. A sub-agent entry starts its
sub-agents beside the session, each a session of its own; the session resumes when the
last it waits for has ended (a background one it does not wait for), its next think time
less what they took when recorded (the recording counts that think time from the answer
that started them).

Prompts: a request's `hash_ids` name its 64-token blocks (equal ids, equal blocks; ids are
scoped to a session and its sub-agents, so a run of a session shares nothing with another
run, even of the same recording). Each id becomes 64 pseudo-random tokens, hashed exactly as
the engines hash blocks of the workers' block size (64 divides it, or it divides 64), and
the hashes travel with the request (`SimRequest.block_hashes`), so a 100k-token prompt
costs its blocks, not its tokens. As upstream's `--warm-prefix-pct` (default 0.5), the
first half of a session's system prompt and tool schemas is the same tokens in every
session (Claude Code's, already cached across conversations). A request whose prompt and
output do not fit `max_model_len` is skipped and counted, as upstream skips requests over
`--max-context`; its session goes on with the next one. Of a run of them, the first whose
prompt alone overflows the window is sent, as a harness sends it, and refused (the live box
refuses it: a harness then compacts, and the session's prefix is not used again), taking none
of the session's time as a skip takes none: `on_overflow` hears of it with the blocks of the
session's last prompt past its warm prefix (what the live box keeps of an ending session: its
system prompt and tools).

What a turn's end tells the residency policy is what the live box learns from the answer
(no client hint is invented, `answer_hint`): a tool call (`stop: tool_use`; the trace names
no tools, so no tool class), or a wait on the person (`end_turn`: the tool class `person`;
the person replies p50 203 s later, and comes back), or nothing (no stop recorded); never
an expected wait.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from appliance.domain.block_hash import BlockHash, BlockHasher, RequestKeys, shared_prefix
from appliance.replay.kv_residency.residency import TurnHint
from appliance.replay.sessions.run_window import PASS_STARTS_PER_USER, RunWindow, misses_over_p95
from appliance.sim.engine_io import DEFAULT_VOCAB_SIZE, SimRequest
from appliance.sim.runtime.virtual import Arrival, RequestRecord
from appliance.workload.agent_traces import AgentSessionTrace, TraceRequest, TraceSubagents

TRACE_BLOCK_TOKENS = 64
WARM_PREFIX_SHARE = 0.5
"""Upstream's `--warm-prefix-pct` default: the shared share of system and tool tokens."""
_WARM = "warm"
_ONE_PASS_NO_WARMUP = RunWindow(math.inf, 0.0)
PERSON = "person"
"""The wait after an answer that called no tool: the person's reply (`answer_hint`)."""


@dataclass(slots=True)
class _SessionRun:
    """One session running: a user's, or a sub-agent of one."""

    sid: str
    steps: Sequence[TraceRequest | TraceSubagents]
    user: int | None
    """The user it runs for (None: a sub-agent)."""
    parent: _SessionRun | None
    """The run waiting for it to end (None: a user's, or a sub-agent nobody waits for)."""
    blocks: dict[tuple[BlockHash | None, tuple[object, ...]], list[BlockHash]]
    """Its blocks' hashes by (parent hash, the ids' keys): shared with its sub-agents."""
    scope: str
    """Where its ids are scoped: its user's session (a sub-agent's, its parent's)."""
    warm_ids: tuple[int, ...] = ()
    """The leading ids of its session's first prompt that are the warm prefix."""
    last: tuple[tuple[int, ...], list[BlockHash], int] = ((), [], 0)
    """Its previous prompt: ids, block hashes, and how many leading chunks were warm."""
    step: int = 0
    children: int = 0
    credit_s: float = 0.0
    """Of its next think time, what the sub-agents it waited for took when recorded."""


@dataclass(slots=True)
class SessionCounts:
    """What the loop did besides sending requests."""

    sessions_started: int = 0
    sessions_finished: int = 0
    subagents: int = 0
    skipped_for_window: int = 0
    skipped_tokens: int = 0
    by_user: dict[int, int] = field(default_factory=dict)
    """Sessions each user started."""


class SessionLoop:
    """Arrivals for `virtual.replay(..., on_finish=loop.on_finish)`, from `sessions`."""

    def __init__(
        self,
        sessions: Sequence[AgentSessionTrace],
        *,
        users: int,
        hasher: BlockHasher,
        max_model_len: int,
        window: RunWindow = _ONE_PASS_NO_WARMUP,
        warm_share: float = WARM_PREFIX_SHARE,
        tenant: str = "agents",
        clairvoyant: bool = False,
    ) -> None:
        if not sessions:
            raise ValueError("no sessions to replay")
        if users < 1:
            raise ValueError(f"users must be at least 1, got {users}")
        bs = hasher.block_size
        if TRACE_BLOCK_TOKENS % bs and bs % TRACE_BLOCK_TOKENS:
            raise ValueError(f"block size {bs}: it must divide 64 or be a multiple of 64")
        self._sessions = sessions
        self.users = users
        self._hasher = hasher
        self._keys = RequestKeys(cache_salt=tenant)
        self.max_model_len = max_model_len
        self.duration_s = window.duration_s
        self.warmup_s = window.warmup_s
        self._warm_share = warm_share
        self.tenant = tenant
        self.clairvoyant = clairvoyant
        self._warm_blocks: dict[tuple[BlockHash | None, tuple[object, ...]], list[BlockHash]] = {}
        self._next_session = 0
        self.one_pass = math.isinf(self.duration_s)
        """Every session starts once: the window ends as the last one starts."""
        self.pass_starts = max(len(sessions), PASS_STARTS_PER_USER * users)
        """Sessions one pass starts: the list, cycled up to `PASS_STARTS_PER_USER` a user."""
        self.last_start_s = math.inf
        self._runs: dict[str, tuple[_SessionRun, TraceRequest]] = {}  # request id -> its run
        self._session_of: dict[str, str] = {}
        self.counts = SessionCounts()
        self._slo_s = window.give_up_over_p95_s if self.one_pass else None
        self._misses_left = (
            misses_over_p95(sessions, self.pass_starts, max_model_len)
            if self._slo_s is not None
            else 0
        )
        self.gave_up_s = math.inf
        """When the counted p95 was sure to miss `give_up_over_p95_s` (inf: never)."""
        self.ended: set[str] = set()
        """The runs (sessions and sub-agents) that ran to their end."""
        self.on_overflow: Callable[[str, Sequence[BlockHash], float], None] | None = None
        """(session, its own blocks, now): its next prompt does not fit the window."""

    # --- driving the replay ---

    def arrivals(self) -> Iterator[Arrival]:
        """Every user's first request; the rest come from `on_finish`."""
        for user in range(self.users):
            yield from self._start_user(user, user * self.warmup_s / self.users)

    def on_finish(self, rec: RequestRecord) -> list[Arrival]:
        run, _ = self._runs.pop(rec.request_id)
        now = rec.finish_s if rec.finish_s is not None else rec.arrival_s
        run.step += 1
        if self._sure_to_miss(rec, now):
            return []
        return self._advance(run, now)

    def _sure_to_miss(self, rec: RequestRecord, now: float) -> bool:
        """Counts the turn against `give_up_over_p95_s`; True when it makes the miss sure
        (the window ends now)."""
        ttft = rec.ttft_s
        if self._slo_s is None or ttft is None or ttft <= self._slo_s:
            return False
        if not self.warmup_s < rec.arrival_s <= self.end_s:
            return False
        self._misses_left -= 1
        if self._misses_left > 0:
            return False
        self.gave_up_s = min(self.gave_up_s, now)
        return True

    @property
    def passed(self) -> bool:
        """One pass: every session of the pass has started."""
        return self.one_pass and self._next_session >= self.pass_starts

    @property
    def end_s(self) -> float:
        """Where the counted window ends: the run's end, the last session's start, or where
        its p95 was sure to miss."""
        return min(self.duration_s, self.last_start_s, self.gave_up_s)

    def hint(self, request_id: str) -> TurnHint | None:
        """What the turn's answer tells: whether it ended in a tool call (see the module).
        `clairvoyant`: also the true wait before the session's next request (the recording's
        think time) and whether it has none (for the bound, which no client could give)."""
        found = self._runs.get(request_id)
        if found is None:
            return None
        run, step = found
        hint = answer_hint(step)
        if not self.clairvoyant:
            return hint
        wait = self._next_wait(run)
        ends = wait is None
        return TurnHint(hint.ends_in_tool_call, hint.tool_class, wait, session_ends=ends)

    def _next_wait(self, run: _SessionRun) -> float | None:
        """The recorded wait from the run's current request's answer to its next request
        (one past sub-agents counts them; None: it has none)."""
        for step in run.steps[run.step + 1 :]:
            if isinstance(step, TraceSubagents):
                continue
            if step.fits(self.max_model_len):
                return step.think_time_s
        return None

    def sessions(self) -> dict[str, str]:
        """Request id -> session id, for every request sent."""
        return dict(self._session_of)

    # --- the loop ---

    def _start_user(self, user: int, at_s: float) -> list[Arrival]:
        if at_s > self.end_s or self.passed:
            return []
        trace = self._sessions[self._next_session % len(self._sessions)]
        self._next_session += 1
        if self.one_pass and self._next_session == self.pass_starts:
            self.last_start_s = at_s  # the last session starts: the counted window ends
        n = self.counts.by_user[user] = self.counts.by_user.get(user, 0) + 1
        sid = f"u{user}.{n}:{trace.session_id}"
        warm = int(self._warm_share * (trace.system_tokens + trace.tool_tokens)) // 64
        first = next((s for s in trace.steps if isinstance(s, TraceRequest)), None)
        warm_ids = first.hash_ids[:warm] if first is not None else ()
        run = _SessionRun(sid, trace.steps, user, None, {}, sid, warm_ids)
        self.counts.sessions_started += 1
        return self._advance(run, at_s)

    def _advance(self, run: _SessionRun, now: float) -> list[Arrival]:
        """The run's next request (after its think time), its sub-agents, or its end."""
        overflowed = False
        while run.step < len(run.steps):
            step = run.steps[run.step]
            if isinstance(step, TraceSubagents):
                return self._spawn(run, step, now)
            if not step.fits(self.max_model_len):
                self.counts.skipped_for_window += 1
                self.counts.skipped_tokens += step.input_tokens
                run.step += 1
                if not overflowed and step.overflows(self.max_model_len):
                    overflowed = True
                    self._overflowed(run, now)
                continue
            at_s = now + max(0.0, step.think_time_s - run.credit_s)
            run.credit_s = 0.0
            if at_s > self.end_s:
                return []  # past the window's end: the user sends nothing more
            return [Arrival(at_s, self._request(run, step, at_s))]
        return self._ended(run, now)

    def _spawn(self, run: _SessionRun, step: TraceSubagents, now: float) -> list[Arrival]:
        run.step += 1
        out: list[Arrival] = []
        for i, agent in enumerate(step.agents):
            waits = agent.parent_waits  # else it runs in the background: nobody waits
            child = _SessionRun(
                f"{run.sid}/sa{run.step}.{i}",
                agent.requests,
                None,
                run if waits else None,
                run.blocks,
                run.scope,
            )
            run.children += waits
            if waits:
                run.credit_s = max(run.credit_s, agent.duration_s or 0.0)
            self.counts.subagents += 1
            out += self._advance(child, now)
        return out if run.children else out + self._advance(run, now)

    def _overflowed(self, run: _SessionRun, now: float) -> None:
        _, hashes, warm_chunks = run.last
        if self.on_overflow is not None and hashes:
            bs = self._hasher.block_size
            blocks_per_chunk = max(1, bs // TRACE_BLOCK_TOKENS) * TRACE_BLOCK_TOKENS // bs
            self.on_overflow(run.sid, hashes[warm_chunks * blocks_per_chunk :], now)

    def _ended(self, run: _SessionRun, now: float) -> list[Arrival]:
        self.ended.add(run.sid)
        parent = run.parent
        if parent is not None:
            parent.children -= 1
            return self._advance(parent, now) if parent.children == 0 else []
        if run.user is None:
            return []  # a sub-agent in the background
        self.counts.sessions_finished += 1
        return self._start_user(run.user, now)

    # --- prompts ---

    def _request(self, run: _SessionRun, step: TraceRequest, at_s: float) -> SimRequest:
        rid = f"{run.sid}/{run.step}"
        self._runs[rid] = (run, step)
        self._session_of[rid] = run.sid
        return SimRequest(
            request_id=rid,
            prompt_token_ids=[0] * step.input_tokens,
            max_tokens=max(step.output_tokens, 1),
            cache_salt=self.tenant,
            session_id=run.sid,
            arrival_s=at_s,
            block_hashes=self._hashes(run, step),
        )

    def _hashes(self, run: _SessionRun, step: TraceRequest) -> list[BlockHash]:
        """The prompt's full blocks' hashes, each id's once per run (see the module): the
        chunks it shares with the run's previous prompt are that prompt's hashes."""
        bs = self._hasher.block_size
        per = max(1, bs // TRACE_BLOCK_TOKENS)  # ids per hashed chunk
        blocks_per = per * TRACE_BLOCK_TOKENS // bs  # blocks per chunk
        ids, n_full = step.hash_ids, step.input_tokens // bs
        prev_ids, prev_hashes, prev_warm = run.last
        reused = min(shared_prefix(prev_ids, ids) // per, len(prev_hashes) // blocks_per)
        out = list(prev_hashes[: reused * blocks_per])
        warm_chunks = min(reused, prev_warm)
        warm = reused <= prev_warm  # every chunk so far is the warm prefix's
        for start in range(reused * per, len(ids) - per + 1, per):
            if len(out) >= n_full:
                break
            keys: list[object] = []
            for j, x in enumerate(ids[start : start + per]):
                warm = warm and start + j < len(run.warm_ids) and x == run.warm_ids[start + j]
                keys.append((_WARM, start + j) if warm else x)
            warm_chunks += warm
            memo = self._warm_blocks if warm else run.blocks
            parent = out[-1] if out else None
            hashes = memo.get((parent, tuple(keys)))
            if hashes is None:
                tokens = block_tokens(keys, _WARM if warm else run.scope)
                hashes = memo[(parent, tuple(keys))] = self._hasher.hash_after(
                    tokens, first_block=len(out), parent=parent, keys=self._keys
                )
            out += hashes
        run.last = (ids, out, warm_chunks)
        return out[:n_full]


def answer_hint(step: TraceRequest) -> TurnHint:
    """What an answer's stop reason tells, as the live box reads it: `tool_use`, a tool
    call (the trace names no tool); `end_turn`, a wait on the person (`PERSON`), who comes
    back; no stop recorded, nothing known."""
    if step.stop == "tool_use":
        return TurnHint(True)
    if step.stop == "end_turn":
        return TurnHint(True, PERSON)
    return TurnHint(None)


def block_tokens(keys: Sequence[object], scope: str) -> list[int]:
    """64 pseudo-random tokens per key, the same for the same key in the same scope:
    `(base + 7919 * i) % DEFAULT_VOCAB_SIZE` for i < 64, `base` the key's CRC-32."""
    out: list[int] = []
    for key in keys:
        at = zlib.crc32(f"{scope}/{key}".encode()) * _STRIDE_INVERSE % DEFAULT_VOCAB_SIZE
        out += _STRIDE_WALK[at : at + TRACE_BLOCK_TOKENS]
    return out


# The stride is prime to the vocabulary, so base = 7919 * at (mod the vocabulary) for one
# `at`, and a key's tokens are the 64 steps of the stride's walk from there: one slice.
_STRIDE = 7919
_STRIDE_INVERSE = pow(_STRIDE, -1, DEFAULT_VOCAB_SIZE)
_STRIDE_WALK = [_STRIDE * k % DEFAULT_VOCAB_SIZE for k in range(DEFAULT_VOCAB_SIZE + 64)]
