"""Quantities on the command line: byte sizes (``100KiB``, ``2.5MiB``,
``1GB``, ``4096``) and durations (``5ms``, ``1.5s``)."""

from __future__ import annotations

__all__ = ["parse_bytes", "format_bytes", "parse_duration_ms"]

# The same grammar as the stage and the policies (policies/src/quantity.rs):
# units are case-sensitive, SI prefixes are powers of 1000 and IEC ones
# powers of 1024, and `K`/`KB` is refused as ambiguous. Both parsers are
# tested against policies/src/byte_size_cases.txt.
_UNITS = {
    "": 1, "B": 1,
    "k": 1000, "kB": 1000, "M": 1000**2, "MB": 1000**2, "G": 1000**3, "GB": 1000**3,
    "T": 1000**4, "TB": 1000**4,
    "Ki": 1024, "KiB": 1024, "Mi": 1024**2, "MiB": 1024**2, "Gi": 1024**3, "GiB": 1024**3,
    "Ti": 1024**4, "TiB": 1024**4,
}
_HELP = ("write a number with an optional unit: B, kB, MB, GB, TB (powers of 1000) "
         "or KiB, MiB, GiB, TiB (powers of 1024)")
_NUMBER = frozenset("0123456789.")


def parse_bytes(text: "str | int") -> int:
    """Returns the number of bytes ``text`` names: ``4096``, ``100KiB``,
    ``2.5MiB``, ``1GB``, ``100kB``.

    Raises ``ValueError`` saying what to write otherwise, in the stage's
    words.
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"invalid byte size `{text}`: quantities cannot be negative")
        return text
    return _scale(str(text))


def _scale(text: str) -> int:
    def refuse(reason: str) -> ValueError:
        return ValueError(f"invalid byte size `{text}`: {reason}")

    trimmed = text.strip()
    split = next((i for i, c in enumerate(trimmed) if c not in _NUMBER), len(trimmed))
    number, unit = trimmed[:split], trimmed[split:].lstrip()
    if not number:
        if trimmed.startswith("-"):
            raise refuse("quantities cannot be negative")
        raise refuse(f"it does not start with a number; {_HELP}")
    if unit in ("K", "KB", "Kb", "kb"):
        raise refuse("`K`/`KB` is ambiguous: write `kB` for 1000 bytes or `KiB` for 1024 bytes")
    if unit not in _UNITS:
        raise refuse(f"unknown unit `{unit}`; {_HELP}")
    whole, dot, fraction = number.partition(".")
    if not whole or "." in fraction or (dot and not fraction):
        raise refuse("malformed number")
    scaled = int(whole + fraction) * _UNITS[unit]
    divisor = 10 ** len(fraction)
    if scaled % divisor:
        raise refuse("it is not a whole number of bytes")
    value = scaled // divisor
    if value >= 1 << 64:
        raise refuse("the number is too large")
    return value


def parse_duration_ms(text: str) -> float:
    """Returns the milliseconds ``text`` names, in the stage's grammar for
    durations: a number and the unit ``ms`` or ``s`` (``5ms``, ``1.5s``;
    whole milliseconds)."""
    trimmed = str(text).strip()
    for unit, factor in (("ms", 1), ("s", 1000)):
        if trimmed.endswith(unit):
            number = trimmed[: -len(unit)].strip()
            break
    else:
        raise ValueError(f"invalid duration `{text}`: write a unit: `ms` or `s`, for example `100ms` or `1.5s`")
    if not number or set(number) - _NUMBER or number.count(".") > 1 or number.startswith(".") \
            or number.endswith("."):
        raise ValueError(f"invalid duration `{text}`: write for example `100ms` or `1.5s`")
    whole, _, fraction = number.partition(".")
    scaled = int(whole + fraction) * factor
    if scaled % 10 ** len(fraction):
        raise ValueError(f"invalid duration `{text}`: it is not a whole number of milliseconds")
    return float(scaled // 10 ** len(fraction))


def format_bytes(n: float) -> str:
    """Returns ``n`` bytes in binary units, short (``100KiB``, ``1.5GiB``)."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= scale:
            v = n / scale
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.1f}{unit}"
    return f"{int(n)}B"
