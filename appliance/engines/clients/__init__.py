"""The appliance's side of a running worker, whoever started it: the HTTP clients
(`vllm_client.py` over the lean HTTP/1.1 pool of `http1.py`; `outside_http.py` for
an outside endpoint), the Prometheus scrape (`metrics.py`), the KV-event
subscription (`kv_events.py`) and the router's handle on the worker (`workers.py`)."""
