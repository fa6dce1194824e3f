"""The GPU's performance model, shared by the live appliance, the simulator and the replay:
a calibration profile (`profile`), the latency model fitted to it (`latency`) and the KV
pool a GPU of that profile holds (`kv_capacity`). Pure: stdlib and the domain only."""
