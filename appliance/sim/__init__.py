"""A GPU-less engine that speaks vLLM 0.32's protocols, checked against real vLLM: its
core (`core/`), KV memory (`kv/`), what runs it in time (`runtime/`) and its HTTP face
(`entrypoints/`); what goes in and out of an engine, which all of them speak, in
`engine_io.py`."""
