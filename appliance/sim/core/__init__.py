"""The simulated engine core: vLLM's scheduler over the prefix cache, timed by a latency
model (`engine.py` and the parts mixed into it), its settings, its counters, the
waiting queue and the plain-decode run. What goes in and out of it is
`appliance/sim/engine_io.py`, the vocabulary every part of the sim speaks."""
