"""`appliance bench`: concurrent agent sessions against a running appliance over HTTP only
(the `openai` client and `/v1/tasks`), reporting per-step and per-task latency and the
cache's share of the prompt tokens."""

from appliance.bench.run import run_bench

__all__ = ["run_bench"]
