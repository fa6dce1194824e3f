"""The appliance process's start: the CLI's composition root (`bootstrap`), `appliance up`
(`daemon`: the configured engines started, `engine_start`, wired into the services and the
API, `wiring` with `wiring_escalation` and `wiring_residency`, who may call it, `access`,
the KV bytes per token served, `served_kv`, the task classes' paces restored from the
ledger, `class_paces`, systemd's notifications, `sdnotify`), the running instance of a data
dir and its reload (`instance`, `live_reload`), and the commands that prepare the host
(`doctor`, `service_files`)."""
