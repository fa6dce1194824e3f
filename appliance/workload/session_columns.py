"""The figures a run of recorded agent sessions is shown by, replayed
(`appliance replay DIR`) or live (`appliance bench --trace DIR`), so the two tables line up."""

from __future__ import annotations

SESSION_COLUMNS = (
    "users",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "hit_rate",
    "step_p50_s",
    "session_p50_s",
    "requests",
    "skipped_for_window",
)
