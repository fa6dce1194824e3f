"""Recorded agent sessions (kv-cache-tester's) replayed closed loop through the
stacks a self-hoster could run: the session loop (`session_loop.py`), one stack's
replay and the capacity search (`session_replay.py`), what a run spends
(`session_usage.py`), the clairvoyant bound (`session_bound.py`) and the report
(`session_report.py`)."""
