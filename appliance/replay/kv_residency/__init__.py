"""Where a session's KV lives between its turns, in the replay: a residency policy
driving the simulated engines' pins (`residency.py`), restore on lead time
(`prefetch.py`) and branch-local state (`branches.py`)."""
