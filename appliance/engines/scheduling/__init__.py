"""The scheduler each vLLM worker the appliance starts runs (`prompt_a_step.py`, imported by
vLLM only, through `--scheduler-cls`), and the name the command line gives it (here: stdlib
only, for the launch and the simulator)."""

SCHEDULER_CLS = "appliance.engines.scheduling.prompt_a_step.one_prompt_a_step"
"""`--scheduler-cls`: one prompt a step while two or more are in flight."""
