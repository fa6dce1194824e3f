"""Adapters to inference engines: the vLLM client, the worker supervisor, external endpoints."""
