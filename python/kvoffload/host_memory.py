"""This machine's memory, as the worker checks its CPU pool against it."""

from __future__ import annotations


def host_memory() -> tuple[int, int] | None:
    """``(total, available)`` bytes of this machine's memory, from ``/proc/meminfo``;
    ``None`` where it cannot be read."""
    fields: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    if len(fields) != 2:
        return None
    return fields["MemTotal"], fields["MemAvailable"]
