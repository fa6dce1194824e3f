"""Host memory and CPU through psutil: the tier the reaper demotes KV to."""

from __future__ import annotations

import os

import psutil

from appliance.domain.gpu import HostReading


def read_host() -> HostReading:
    mem = psutil.virtual_memory()
    return HostReading(
        mem_total_bytes=int(mem.total),
        mem_available_bytes=int(mem.available),
        cpu_count=os.cpu_count() or 1,
        load_1m=os.getloadavg()[0],
    )
