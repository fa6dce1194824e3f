"""A ledger on a 'full disk', in its own process (a file-size limit stands in for the disk:
writes past it fail as a full disk's do), for test_ledger_full_disk.py.

    python ledger_full_disk_proc.py DB

Prints one JSON line: what the ledger said before, during and after the shortage.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
from pathlib import Path

from appliance.domain.errors import LedgerUnavailable
from appliance.domain.records import TaskId, TaskRecord, TenantId
from appliance.ledger import LedgerWriter


def task(n: int) -> TaskRecord:
    return TaskRecord(TaskId(f"t/{n}"), TenantId("t"), float(n), task_class="x" * 200)


def main() -> None:
    db = Path(sys.argv[1])
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails, no signal
    ledger = LedgerWriter.open(db)
    out: dict[str, object] = {}
    for n in range(20):
        ledger.record_task(task(n)).result()
    out["before"] = ledger.failing
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    biggest = max(os.path.getsize(p) for p in db.parent.iterdir() if p.name.startswith(db.name))
    resource.setrlimit(resource.RLIMIT_FSIZE, (biggest, hard))  # the disk is full
    lost = 0
    for n in range(20, 400):
        try:
            ledger.record_task(task(n)).result()
        except LedgerUnavailable:
            lost += 1
    out["lost"] = lost
    out["during"] = ledger.failing
    try:
        ledger.probe().result()
        out["probe_while_full"] = "committed"
    except LedgerUnavailable:
        out["probe_while_full"] = "refused"
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # room again
    ledger.probe().result()
    out["after_probe"] = ledger.failing
    ledger.record_task(task(1000)).result()
    ledger.close()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
