"""The mechanisms that own state and side effects, through `appliance.ports`, one subpackage
per concern: a turn's way (`turns`), sessions (`sessions`), tasks and admission (`tasks`),
KV residency and the idle reaper (`residency`), the workers (`workers`), the operator's
view (`operator`) and escalation to outside endpoints (`escalation`)."""
