"""The scheduler each vLLM worker the appliance starts runs (`prefill_cap.py`, imported by
vLLM only, through `--scheduler-cls`), and the name the command line gives it (here: stdlib
only, for the launch and the simulator)."""

SCHEDULER_CLS = "appliance.engines.scheduling.prefill_cap.cap_beside_prefill"
"""`--scheduler-cls`: a prefill is cut to the long prefill threshold only beside another."""
