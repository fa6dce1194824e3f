"""What the idle reaper is told of a waiting session, read from the live appliance.

Model of the world: a session's turn has just ended on its worker (or a hold of it has come
due). The policy (the reaper, `appliance.policy.reaper`, by default) weighs the session's
expected wait against the re-prefill its KV saves and what HBM is worth now; this builds its
`IdleSession` from what the appliance knows at that instant:

- resident tokens: the leading tokens of the session's last prompt the KV index sees on the
  worker's GPU tier, and at a turn's end at least the prompt's full blocks the worker has
  just computed (its KV events may arrive a moment after the answer);
- re-prefill seconds: those tokens at the worker's measured prefill speed (the GPU
  profile's, times its measured slowdown: `services/workers/worker_speed.py`);
- promotion seconds: those tokens' KV copied from host memory back to the GPU (the GPU
  profile's host-to-device copy, `LiveInputs.copy_in_s`);
- the tenant's held bytes on the worker (its other sessions' holds there, its own not
  counted), added by the loop from the holds it has sent (`live_holds.LiveHolds`), where
  the policy caps a tenant's holds;
- HBM pressure: the share of the worker's KV pool that requests and holds take, from its
  retention connector's latest report when it has one, else vLLM's `kv_cache_usage_perc`
  (the same measure, polled); a GPU's NVML memory reading says nothing of it, since vLLM
  allocates the whole pool at start;
- the host tier, where the worker's retention reports show one: room for the whole session
  (it is a cache that evicts to make room), its use as its pressure, and its size against
  the GPU pool's (what it displaces when full is that much further from use);
- what the session waits on (`tool_waits.py`): the tools its answer called (their names
  its tool class), or the person (`person`) when the answer called none; the client's
  `X-Tool-Class` and `X-Expected-Tool-Wait-S`, when sent, as hints that win for their turn;
  and the session's depth from its turns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from appliance.domain.kv_events import Medium
from appliance.domain.records import TaskId, WorkerId
from appliance.policy.residency import HostTierReading, IdleSession, ResidencyAction
from appliance.ports import KvLookup, KvRetention, WorkerEndpoint
from appliance.services.residency.tool_waits import TurnWait
from appliance.services.sessions.sessions import SessionState


@dataclass(frozen=True, slots=True)
class LiveInputs:
    """Where the reaper loop reads the live appliance."""

    index: KvLookup
    workers: Callable[[], Sequence[WorkerEndpoint]]
    prefill_s: Callable[[WorkerId, int], float]
    """(worker, tokens) -> seconds a prefill of that many fresh tokens takes there now."""
    task_closed: Callable[[TaskId], bool]
    """Whether the task a client named has closed (succeeded, failed, cancelled; a one-turn
    task's `done` is no end of the session that named it)."""
    kv_bytes_per_token: int
    model: str
    runtime_identity: str
    """With `model`: what the cache receipts of this appliance are kept against."""
    copy_in_s: Callable[[int], float] = lambda tokens: 0.0
    """(tokens) -> seconds to copy that many tokens' KV from host memory to a GPU."""
    task_parent: Callable[[TaskId], TaskId | None] = lambda task: None
    """The parent of a task a client named (None: a root, or unknown)."""


def retention_key(session: SessionState) -> str:
    """The key a worker keeps the session's KV under: the `session_id` the turn desk
    forwards in every turn's body."""
    return f"{session.tenant}/{session.session_id}"


def prefix_tokens(session: SessionState) -> int:
    """Tokens of the full blocks of the session's last prompt (its cache receipt's)."""
    chain = session.chain
    return len(chain.hashes) * chain.block_size if chain is not None else 0


def resident_tokens(
    index: KvLookup, session: SessionState, worker: WorkerId, medium: str = Medium.GPU
) -> int:
    """Leading tokens of the session's last prompt on the worker's GPU tier (or `medium`)."""
    chain = session.chain
    if chain is None or not chain.hashes:
        return 0
    blocks = index.lookup(chain.event_hashes, medium=medium).get(worker, 0)
    return blocks * chain.block_size


def host_reading(
    inputs: LiveInputs, retention: KvRetention, worker: WorkerId, block_size: int
) -> HostTierReading | None:
    """The worker's host tier as the policy sees it (see the module); None: it has none."""
    tier = retention.host_tier(worker)
    if tier is None:
        return None
    room = tier.blocks * block_size * inputs.kv_bytes_per_token
    return HostTierReading(room, tier.used_blocks / tier.blocks, turnover=tier.turnover)


def kv_usage(inputs: LiveInputs, retention: KvRetention, worker: WorkerId) -> float:
    """The worker's HBM pressure now, 0..1 (see the module)."""
    reported = retention.kv_usage(worker)
    if reported is not None:
        return reported
    endpoint = next((w for w in inputs.workers() if w.id == worker), None)
    load = endpoint.load if endpoint is not None else None
    return load.kv_cache_usage_perc if load is not None else 0.0


def idle_session(
    inputs: LiveInputs,
    retention: KvRetention,
    session: SessionState,
    worker: WorkerId,
    tokens: int,
    *,
    finished_at_s: float,
    wait: TurnWait,
) -> IdleSession:
    """The policy's view of the session, waiting since `finished_at_s` on `worker` with
    `tokens` of its prefix resident there, on what `wait` says."""
    idle = IdleSession(
        session_id=retention_key(session),
        resident_tokens=tokens,
        finished_at_s=finished_at_s,
        ends_in_tool_call=wait.ends_in_tool_call,
        tool_class=wait.tool_class,
        turns=session.turns,
        expected_wait_s=wait.expected_wait_s,
        tenant=session.tenant,
    )
    return measured(inputs, retention, idle, session, worker, tokens)


def measured(
    inputs: LiveInputs,
    retention: KvRetention,
    idle: IdleSession,
    session: SessionState,
    worker: WorkerId,
    tokens: int,
) -> IdleSession:
    """`idle` as the worker stands now: `tokens` of the session's prefix resident there
    (their bytes, re-prefill seconds and seconds to copy back from the host tier), the
    worker's HBM pressure and its host tier."""
    block = session.chain.block_size if session.chain is not None else 0
    return replace(
        idle,
        resident_tokens=tokens,
        kv_bytes=tokens * inputs.kv_bytes_per_token,
        recompute_s=inputs.prefill_s(worker, tokens) if tokens else 0.0,
        promote_s=inputs.copy_in_s(tokens) if tokens else 0.0,
        kv_usage=kv_usage(inputs, retention, worker),
        host=host_reading(inputs, retention, worker, block),
    )


def inherited_blocks(
    task_parent: Callable[[TaskId], TaskId | None], session: SessionState, others: Iterable[Any]
) -> int:
    """Leading blocks of a branch's prompt (a child task's session) that its parent task's
    sessions among `others` share: what its end must leave to them. 0 for a root's session;
    all of them when its parent's sessions are not among `others` (nothing is known to be
    its own). `others`: sessions, or what holds one as `.session` (the reaper's waiting)."""
    chain = session.chain
    parent = task_parent(session.task_id) if session.task_id is not None else None
    if chain is None or parent is None:
        return 0
    sessions = [getattr(o, "session", o) for o in others]
    shared = [
        _common_blocks(chain.hashes, o.chain.hashes)
        for o in sessions
        if o.task_id == parent and o.chain is not None
    ]
    return max(shared) if shared else len(chain.hashes)


def kept_blocks(
    task_parent: Callable[[TaskId], TaskId | None], ending: Any, waiting: Iterable[Any]
) -> tuple[int, int]:
    """(kept, inherited): leading blocks of an ending session's prompt that its end leaves
    cached, behind what other sessions use (only the rest goes first in the eviction order),
    and of those a branch's inheritance (`inherited_blocks`). Kept: its stem (the system
    prompt and tool schemas its agent's next session sends again), what a session of its
    tenant waiting on the same worker, whose KV is not going, shares with it, and what it
    inherited. `ending` and `waiting` hold a session as `.session`, with `.worker` and
    `.decision` (the reaper's waiting sessions)."""
    session, waiting = ending.session, list(waiting)
    inherited = inherited_blocks(task_parent, session, waiting)
    chain = session.chain
    if chain is None or not chain.hashes:
        return 0, 0
    stem = session.stem_tokens // chain.block_size
    shared = max(
        (
            _common_blocks(chain.hashes, o.session.chain.hashes)
            for o in waiting
            if o.session is not session
            and o.worker == ending.worker
            and o.session.tenant == session.tenant
            and o.session.chain is not None
            and o.decision.action is not ResidencyAction.EVICT
        ),
        default=0,
    )
    return min(len(chain.hashes), max(stem, shared, inherited)), inherited


def _common_blocks(a: Sequence[object], b: Sequence[object]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
