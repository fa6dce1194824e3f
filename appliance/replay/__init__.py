"""Trace replay: the appliance's routing and the anchors' policies, each under each
residency policy, on the same simulated workers, against the offline bounds (`runner.py`
states the model of the world); closed-loop agent workloads the same way (`run_workload`).

    report = run_replay(Path("trace.jsonl"), policies=None, residencies=["lru", "ttl-pin"],
                        workers=8, gpu_profile=None, hbm_gib=None,
                        report=Path("replay.json"), progress=True)
    print(render_table(report))
"""

from appliance.policy.residency_by_name import RESIDENCY_NAMES
from appliance.replay.api import run_replay, run_workload
from appliance.replay.report import render_table
from appliance.replay.routers import POLICY_NAMES

__all__ = ["POLICY_NAMES", "RESIDENCY_NAMES", "render_table", "run_replay", "run_workload"]
