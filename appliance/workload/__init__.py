"""Agent workloads: the spec (`configs/workload.yaml`), the generator, recorded traces as
workloads. Plain values only; no HTTP, no clock (see `model` for the model of the world)."""

from appliance.workload.generate import generate, iter_trees, task_tree
from appliance.workload.model import SUBAGENT_TOOL, AgentTask, AgentTurn, TaskTree, Workload
from appliance.workload.spec import WorkloadSpec, load_spec, parse_spec
from appliance.workload.trace import load_trace_workload

__all__ = [
    "SUBAGENT_TOOL",
    "AgentTask",
    "AgentTurn",
    "TaskTree",
    "Workload",
    "WorkloadSpec",
    "generate",
    "iter_trees",
    "load_spec",
    "load_trace_workload",
    "parse_spec",
    "task_tree",
]
