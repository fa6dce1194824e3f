"""Trace replay: the appliance's routing and the anchors' policies on the same simulated
workers, against the offline bounds (`runner.py` states the model of the world).

    report = run_replay(Path("trace.jsonl"), policies=None, workers=8, gpu_profile=None,
                        hbm_gib=None, report=Path("replay.json"), progress=True)
    print(render_table(report))
"""

from appliance.replay.api import run_replay
from appliance.replay.report import render_table
from appliance.replay.routers import POLICY_NAMES

__all__ = ["POLICY_NAMES", "render_table", "run_replay"]
