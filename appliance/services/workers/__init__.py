"""The workers as the appliance watches and spends them: the worker reaper that sleeps,
stops and wakes idle workers (`worker_reaper`), their restarts and outages as operator
events (`worker_watch`), each worker's measured prefill speed (`worker_speed`), its
GPU-seconds and each attempt's share of them (`gpu_meter`), and the box's own usage,
period by period (`box_usage`)."""
