"""Which processes a test left behind: descendants of the test process that started after a
point in time (servers of session fixtures started earlier are not the test's)."""

from __future__ import annotations

import psutil


def live_children_since(t0: float) -> list[psutil.Process]:
    left = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.create_time() >= t0 - 0.05:
                left.append(p)
        except psutil.NoSuchProcess:
            continue
    return left
