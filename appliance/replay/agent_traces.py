"""The recorded agent sessions' reader, moved to `appliance.workload.agent_traces` (the live
benchmark reads them too, and may not import the replay); kept here under its old path for
the replay's modules that still import it from here."""

from appliance.workload.agent_traces import (
    MAX_FILE_BYTES,
    AgentSessionTrace,
    SubagentTrace,
    TraceRequest,
    TraceSubagents,
    read_agent_sessions,
    sessions_summary,
)

__all__ = [
    "MAX_FILE_BYTES",
    "AgentSessionTrace",
    "SubagentTrace",
    "TraceRequest",
    "TraceSubagents",
    "read_agent_sessions",
    "sessions_summary",
]
