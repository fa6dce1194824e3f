"""The ASGI app: OpenAI-compatible routes, appliance routes, /metrics; and its schemas."""
