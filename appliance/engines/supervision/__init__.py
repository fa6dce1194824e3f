"""The workers the appliance starts: their command line (vLLM's, `launch.py`, or the
simulator's in vLLM's place, `sim_launch.py`), the checks and the ports settled
before any of them starts (`preflight.py`, `port_plan.py`), each one's process
(`worker_process.py`, `supervised_worker.py`), the supervisor that starts, restarts
and stops them (`supervisor.py`), and their sleep, stop and wake
(`power_control.py`)."""
