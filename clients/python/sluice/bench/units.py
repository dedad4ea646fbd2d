"""Byte quantities on the command line: ``100KiB``, ``2.5MiB``, ``1GB``, ``4096``."""

from __future__ import annotations

import re

__all__ = ["parse_bytes", "format_bytes"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_bytes(text: "str | int") -> int:
    """Returns the number of bytes ``text`` names.

    Accepts a plain integer, or a number with a unit: decimal ``KB``/``MB``/
    ``GB``/``TB`` (or ``k``, ``M``, ...) and binary ``KiB``/``MiB``/``GiB``/
    ``TiB``; units are case-insensitive. Raises ``ValueError`` with the
    accepted forms otherwise.
    """
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"a byte quantity must be >= 0, got {text}")
        return text
    m = _RE.match(text)
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot read {text!r} as a byte quantity; write e.g. 4096, 100KiB, 2.5MiB or 1GB")
    return int(round(float(m.group(1)) * _UNITS[unit]))


def format_bytes(n: float) -> str:
    """Returns ``n`` bytes in binary units, short (``100KiB``, ``1.5GiB``)."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{int(n)}B"
