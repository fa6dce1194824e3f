"""GPU and host probes: NVML behind one choke point, psutil, and a scripted fake."""
