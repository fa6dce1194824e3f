"""Per task, what its sessions' KV inherited from its parent, what is its own, and what its
end reclaimed: `services/residency/branch_kv.py` on real sessions and block chains."""

from __future__ import annotations

from appliance.domain.block_hash import BlockHasher, HashAlgo
from appliance.domain.records import SessionId, TaskId, TenantId
from appliance.services.residency.branch_kv import BranchEnds, TaskKv, task_kv, task_kv_of
from appliance.services.sessions.sessions import SessionState, SessionTable

BLOCK = 16
ROOT, KID, ORPHAN = TaskId("acme/root"), TaskId("acme/kid"), TaskId("acme/orphan")
PARENTS = {KID: ROOT, ORPHAN: TaskId("acme/gone")}


def session(table: SessionTable, sid: str, task: TaskId | None, prompt: list[int]) -> SessionState:
    s = table.open(TenantId("acme"), SessionId(sid), 0.0)
    table.hash_prompt(s, prompt, "salt")
    s.task_id = task
    return s


def test_a_childs_kv_is_split_into_its_parents_prefix_and_its_own() -> None:
    table = SessionTable(BlockHasher(HashAlgo.SHA256_CBOR, BLOCK))
    parent_prompt = list(range(8 * BLOCK))
    root = session(table, "r", ROOT, parent_prompt)
    kid = session(table, "k", KID, [*parent_prompt, *range(900, 900 + 3 * BLOCK)])
    orphan = session(table, "o", ORPHAN, [*parent_prompt, *range(700, 700 + BLOCK)])
    loose = session(table, "x", None, list(range(2 * BLOCK)))
    tiers = {
        "r": {"gpu": 8 * BLOCK, "gpu_held": 8 * BLOCK},
        "k": {"gpu": 11 * BLOCK, "gpu_held": 4 * BLOCK, "host": 10 * BLOCK},
        "o": {"gpu": 9 * BLOCK, "gpu_held": 9 * BLOCK},
        "x": {"gpu": 2 * BLOCK},
    }
    ends = BranchEnds()
    ends.ended(ORPHAN, 5.0, 64, 0)
    views = task_kv(
        ((s, tiers[s.session_id]) for s in (root, kid, orphan, loose)), PARENTS.get, ends.get
    )
    assert views[ROOT] == TaskKv(0, 8 * BLOCK, 8 * BLOCK)  # a root inherits nothing
    # its most on any tier (the 11 blocks on the GPU, held or cached), of which the
    # parent's 8 are inherited; kept: of the 10 on the host, past the parent's 8
    assert views[KID] == TaskKv(8 * BLOCK, 3 * BLOCK, 2 * BLOCK)
    # the parent's sessions are not known: none of it is taken for its own
    assert views[ORPHAN] == TaskKv(9 * BLOCK, 0, 0, ends.get(ORPHAN))
    assert set(views) == {ROOT, KID, ORPHAN}  # a session of no task is no task's
    gone = TaskId("acme/ended")
    assert task_kv_of(views, gone, None) == TaskKv()
    assert task_kv_of(views, KID, None) is views[KID]


def test_a_tasks_reclaims_add_up_and_the_oldest_tasks_are_forgotten() -> None:
    ends = BranchEnds(kept=2)
    ends.ended(KID, 1.0, 100, 10)
    ends.ended(KID, 2.0, 50, 5)  # its second session ends later
    kid = ends.get(KID)
    assert kid is not None and (kid.at, kid.own_tokens, kid.inherited_tokens) == (2.0, 150, 15)
    ends.ended(ROOT, 3.0, 7, 0)
    ends.ended(KID, 4.0, 1, 0)  # touched again: newest
    ends.ended(ORPHAN, 5.0, 2, 0)
    assert ends.get(ROOT) is None  # the oldest went
    assert ends.get(KID) is not None and ends.get(ORPHAN) is not None
