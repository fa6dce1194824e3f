"""Where a waiting session's KV lives between turns: the residency driver the replay and the
live box share (`residency_driver`), the idle reaper live, its loop and its tick on the event
loop (`reaper_loop`, `reaper_runner`, `live_holds`), what it is told of each waiting session
(`residency_inputs`, `tool_waits`, `tool_events`, `prefix_watch`, `branch_kv`), restore on
lead time (`lead_time`), the directives it sends the workers' retention connectors
(`retention_outbox`, or `no_retention` where a worker has none), the ledger rows it leaves
(`residency_records`), and where each session's KV is now (`session_kv`)."""
