"""Number formats shared by the console and the terminal tables. A missing reading is "-"."""

from __future__ import annotations

import time

DASH = "-"
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def num(value: int | None) -> str:
    return DASH if value is None else f"{value:,}"


def tokens(value: int | None) -> str:
    """12,345 -> 12.3k, 1,572,600 -> 1.57M; exact below 10,000."""
    if value is None:
        return DASH
    if value < 10_000:
        return str(value)
    if value < 1_000_000:
        return f"{value / 1000:.1f}k"
    return f"{value / 1_000_000:.2f}M"


def size(value: int | None) -> str:
    if value is None:
        return DASH
    amount = float(value)
    for unit in _UNITS:
        if abs(amount) < 1024 or unit == _UNITS[-1]:
            return f"{amount:.0f} {unit}" if unit == "B" else f"{amount:.1f} {unit}"
        amount /= 1024
    raise AssertionError("unreachable")


def gib(value: int | None) -> str:
    return DASH if value is None else f"{value / 2**30:.1f}"


def pct(fraction: float | None, digits: int = 0) -> str:
    return DASH if fraction is None else f"{fraction * 100:.{digits}f}%"


def fine_pct(fraction: float | None) -> str:
    """A share that is often small: 0.0062 -> 0.6%, 0.0004 -> <0.1%, 0.41 -> 41%."""
    if fraction is None:
        return DASH
    if fraction <= 0:
        return "0%"
    if fraction < 0.001:
        return "<0.1%"
    return f"{fraction * 100:.1f}%" if fraction < 0.1 else f"{fraction * 100:.0f}%"


def kv_fill(
    kv_usage: float | None, kv_tokens: int | None, kv_capacity_tokens: int | None
) -> float | None:
    """A worker's KV pool in use, 0..1: what is there, cached blocks included (the KV
    index's tokens against the pool), or vLLM's share held by running requests when that is
    more (it counts partly filled blocks too). vLLM's share alone reads 0 between turns
    however much is cached; it is all there is when the worker does not say its pool's
    size."""
    if kv_tokens is None or not kv_capacity_tokens:
        return kv_usage
    held = min(kv_tokens / kv_capacity_tokens, 1.0)
    return held if kv_usage is None else max(held, kv_usage)


def times(factor: float) -> str:
    """A ratio to a reference: 0.756 -> x0.76."""
    return f"x{factor:.2f}"


def seconds(value: float | None) -> str:
    """Short durations: 0.4s, 12s, 3m05s, 2h04m."""
    if value is None:
        return DASH
    if value < 10:
        return f"{value:.1f}s"
    if value < 60:
        return f"{value:.0f}s"
    whole = int(value)
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def signed_seconds(value: float | None) -> str:
    if value is None:
        return DASH
    return seconds(value) if value >= 0 else "-" + seconds(-value)


def clock(unix_s: float | None) -> str:
    """UTC wall time of a snapshot, HH:MM:SSZ (UTC, so every operator reads the same)."""
    if unix_s is None:
        return DASH
    return time.strftime("%H:%M:%SZ", time.gmtime(unix_s))


def money(value: float | None, currency: str | None = None) -> str:
    if value is None:
        return DASH
    text = f"{value:.4f}" if abs(value) < 1 else f"{value:,.2f}"
    return f"{text} {currency}" if currency else text


def text(value: object) -> str:
    return DASH if value is None or value == "" else str(value)


def worker_state(
    state: str,
    healthy: bool,
    draining: bool,
    sleep_level: int | None,
    lifecycle: str | None = None,
) -> str:
    """A worker's state in a word: one awake by its health (awake, draining, or down when its
    /health fails), else its power state as the appliance says it (asleep with its level,
    stopped, waking). Asleep and stopped are the appliance's own choice, not an outage; a
    stopped worker whose process crashed (`lifecycle` exited: restarting) or that the
    supervisor gave up on (failed) is one, and says so."""
    if state == "stopped" and lifecycle in ("exited", "failed"):
        return "failed" if lifecycle == "failed" else "down"
    if state == "asleep":
        return f"asleep L{sleep_level}" if sleep_level else "asleep"
    if state != "awake":
        return state
    if draining:
        return "draining"
    return "awake" if healthy else "down"
