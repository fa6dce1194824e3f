"""What the operator sees of the running appliance and the hand the operator has on it: the
state snapshot behind `/admin/v1/state` and the console (`state`), the event feed
(`events`), the cost-per-task series of the console's chart (`cost_series`), Prometheus
histograms kept in memory (`histogram`), and the release of one session's KV
(`session_admin`)."""
