"""The agent inference appliance: vLLM workers behind a session router, with a ledger."""

__version__ = "0.1.0"
