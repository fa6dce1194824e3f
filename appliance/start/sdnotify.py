"""systemd's service notification protocol (sd_notify(3)), for `Type=notify` and
`WatchdogSec=`: one datagram per message to the AF_UNIX socket named by `$NOTIFY_SOCKET`
(a path, or an abstract name written with a leading `@`). Outside systemd (no such
variable) every call does nothing.

The appliance sends `READY=1` once its API serves and every worker is up (healthy, or put
to rest by the worker reaper), `WATCHDOG=1` every half of `$WATCHDOG_USEC` from its event
loop (a loop that stalls stops them, and systemd restarts the service), `RELOADING=1` then
`READY=1` around a reload, and `STOPPING=1` when it starts to drain. The variables are
taken out of the environment when read, as sd_notify's `unset_environment` does, so the
workers it starts never see them.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import MutableMapping

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, address: str | None, watchdog_usec: int | None = None) -> None:
        self.address = address
        self.watchdog_s = watchdog_usec / 1e6 if watchdog_usec else None
        """The service's watchdog interval, or None: no watchdog asked for."""
        self._failing = False

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None) -> Notifier:
        env = os.environ if env is None else env
        address = env.pop("NOTIFY_SOCKET", None) or None
        usec = env.pop("WATCHDOG_USEC", None)
        pid = env.pop("WATCHDOG_PID", None)
        mine = pid is None or pid == str(os.getpid())
        watchdog = int(usec) if usec and usec.isdigit() and mine else None
        return cls(address, watchdog)

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, *fields: str) -> bool:
        """One message of `KEY=value` fields; False when there is no socket or it failed (a
        notification is never worth stopping the appliance for)."""
        if self.address is None:
            return False
        target = self.address
        if target.startswith("@"):
            target = "\0" + target[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.setblocking(False)  # a reader that lags never stalls the event loop
                s.connect(target)
                s.send("\n".join(fields).encode())
        except OSError as exc:
            if not self._failing:
                log.warning("sd_notify to %s failed (said once): %s", self.address, exc)
            self._failing = True
            return False
        self._failing = False
        return True

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={status}")

    def reloading(self) -> bool:
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.send("RELOADING=1", f"MONOTONIC_USEC={usec}")

    def stopping(self, status: str) -> bool:
        return self.send("STOPPING=1", f"STATUS={status}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")
