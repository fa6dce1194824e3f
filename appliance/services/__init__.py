"""Async loops that own side effects: router, admission, reaper, state snapshots."""
