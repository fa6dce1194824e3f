"""`appliance service install|uninstall|status [--root DIR]`: the appliance as a systemd
service. Install writes, under DIR (default /) as they lie under /:

- etc/systemd/system/appliance.service, the unit (appliance/data/appliance.service) with
  the path of this `appliance`;
- etc/sysusers.d/appliance.conf, the service's own user for systemd-sysusers;
- etc/appliance/appliance.yaml, every key with its default (kept when it exists: an
  upgrade never overwrites the operator's edits);
- var/lib/appliance, the data dir (0750; systemd hands it to the service's user).

and says what to run next. Uninstall removes the unit and the user's entry and keeps the
config and the data (the ledger is the operator's). Status says which are there and, on the
host itself (DIR is /), what systemctl says of the service.
"""

from __future__ import annotations

import shutil
import subprocess
from importlib import resources
from pathlib import Path

from appliance.config.settings_yaml import documented_yaml
from appliance.domain.errors import ApplianceError

NAME = "appliance"
UNIT = Path("etc/systemd/system/appliance.service")
SYSUSERS = Path("etc/sysusers.d/appliance.conf")
CONFIG = Path("etc/appliance/appliance.yaml")
DATA_DIR = Path("var/lib/appliance")
PLACEHOLDER = "@APPLIANCE@"
NEXT = "systemd-sysusers && systemctl daemon-reload && systemctl enable --now appliance"


class ServiceFilesError(ApplianceError):
    code = "service_files_error"
    exit_code = 1


def unit_text(executable: str) -> str:
    """The unit with `executable` (an absolute path) as the appliance to run."""
    if not executable.startswith("/") or any(c.isspace() or c in "\"'\\$%" for c in executable):
        raise ServiceFilesError(
            f"{executable!r}: the unit needs an absolute path without spaces or quotes; "
            "install the appliance where its path has none (e.g. /opt/appliance)"
        )
    template = resources.files("appliance").joinpath("data/appliance.service").read_text()
    return template.replace(PLACEHOLDER, executable)


def sysusers_text() -> str:
    return resources.files("appliance").joinpath("data/appliance.sysusers").read_text()


def write_service(root: Path, executable: str) -> list[str]:
    """Lay the service's files out under `root`; the lines to print."""
    out = []
    for rel, text in ((UNIT, unit_text(executable)), (SYSUSERS, sysusers_text())):
        _write(root / rel, text, 0o644)
        out.append(f"wrote {root / rel}")
    config = root / CONFIG
    if config.exists():
        out.append(f"kept  {config} (it exists: your settings stay)")
    else:
        _write(config, documented_yaml(), 0o644)
        out.append(f"wrote {config} (every key with its default: set engine.model there)")
    data = root / DATA_DIR
    _mkdir(data, 0o750)
    out.append(f"made  {data} (the data dir: ledger, API keys)")
    out.append(_next(root, NEXT))
    return out


def remove_service(root: Path) -> list[str]:
    """Remove the unit and the user's entry; config and data stay. On this host a running
    service is refused: it would lose its unit while it runs."""
    if _systemctl(root, "is-active") in ("active", "activating", "reloading"):
        raise ServiceFilesError(
            "the appliance service is running; stop it first: sudo systemctl disable --now "
            "appliance"
        )
    out = []
    for rel in (UNIT, SYSUSERS):
        path = root / rel
        if path.exists():
            path.unlink()
            out.append(f"removed {path}")
        else:
            out.append(f"absent  {path}")
    out.append(f"kept    {root / CONFIG} and {root / DATA_DIR} (remove them by hand if unwanted)")
    out.append(_next(root, "systemctl daemon-reload"))
    return out


def describe_service(root: Path) -> tuple[list[str], bool]:
    """Which of the service's files are under `root`, and on this host what systemctl says;
    whether the unit is installed."""
    out = [
        f"{'present' if (root / rel).exists() else 'missing'}  {root / rel}"
        for rel in (UNIT, SYSUSERS, CONFIG, DATA_DIR)
    ]
    for verb in ("is-enabled", "is-active"):
        said = _systemctl(root, verb)
        if said is not None:
            out.append(f"systemctl {verb} {NAME}: {said}")
    return out, (root / UNIT).exists()


def _systemctl(root: Path, verb: str) -> str | None:
    """What `systemctl VERB appliance` says, on this host (root /) where there is one."""
    if root != Path("/") or shutil.which("systemctl") is None:
        return None
    r = subprocess.run(
        ["systemctl", verb, NAME], capture_output=True, text=True, timeout=10, check=False
    )
    return (r.stdout or r.stderr).strip() or f"exit {r.returncode}"


def _next(root: Path, command: str) -> str:
    if root == Path("/"):
        return f"next: sudo sh -c '{command}'"
    return f"next, once {root}/ is laid onto the host's /: sudo sh -c '{command}'"


def _write(path: Path, text: str, mode: int) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text)
        tmp.chmod(mode)
        tmp.replace(path)
    except OSError as exc:
        raise ServiceFilesError(
            f"cannot write {path} ({exc.strerror}); run as root, or pass --root DIR to lay "
            "the files out elsewhere"
        ) from None


def _mkdir(path: Path, mode: int) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(mode)
    except OSError as exc:
        raise ServiceFilesError(
            f"cannot make {path} ({exc.strerror}); run as root, or pass --root DIR"
        ) from None
