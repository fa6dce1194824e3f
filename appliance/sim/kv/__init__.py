"""KV memory of a simulated engine: the GPU's block pool and the prefix cache over it
(its pins and host-tier side), the host tier, a request as the cache sees it, pins and
what a residency hook's answers do to them, prefetches and the host -> GPU copy
channel they share with host loads, the retention connector's twin, and the KV-event
publisher."""
