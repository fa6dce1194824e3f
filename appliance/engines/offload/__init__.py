"""The host tier inside stock vLLM: vLLM's OffloadingConnector composed with the retention
connector (`connector.py`, a MultiConnector), what the retention connector sees of the tier
(`host_view.py`), the CPU build's offloading spec and its torch copies (`cpu_spec.py`,
`host_copy.py`), and the worker's `--kv-transfer-config` (`plan.py`, the only module the
appliance itself imports; the others run inside vLLM)."""
