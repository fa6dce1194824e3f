"""KV retention inside real vLLM: the connector each worker loads (`connector.py`, imported
by vLLM only), its hold bookkeeping (`holds.py`), the control channel between it and the
appliance (`protocol.py`, `channel.py` on the worker's side, `client.py` on the
appliance's) and what a worker's command line needs to load it (`plugin.py`)."""
