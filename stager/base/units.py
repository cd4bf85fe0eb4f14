"""Numbers as operators write them: byte sizes and durations ("20GiB", "6h"), and the one rule for
every numeric option and environment variable (`parse_number`); byte sizes as reports print them."""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024, "kib": 1024, "kb": 1000,
    "m": 1024**2, "mib": 1024**2, "mb": 1000**2,
    "g": 1024**3, "gib": 1024**3, "gb": 1000**3,
    "t": 1024**4, "tib": 1024**4, "tb": 1000**4,
    "p": 1024**5, "pib": 1024**5, "pb": 1000**5,
}
# Sizes land in 64-bit fields (statvfs figures, offsets): a larger one is a typo, not a disk.
MAX_SIZE = 2**63 - 1
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Parse "20GiB", "500 MB", "1.5T" or a plain integer into bytes.

    Bare K/M/G/T are binary, as `df -h` prints them; a bare integer is bytes. Raises ValueError.
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        # A TOML float (`reserve = 1.5`) once became 1 byte: a bare number is whole bytes, or nothing.
        raise ValueError(f"expected a size like '20GiB' or a whole number of bytes, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError("a size cannot be negative")
        if text > MAX_SIZE:
            raise ValueError(f"{text} is larger than any disk (at most {format_size(MAX_SIZE)})")
        return text
    match = _SIZE.match(text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"expected a size like '20GiB' or '500MB', got {text!r}")
    unit = _UNITS[match.group(2).lower()]
    if unit == 1 and "." in match.group(1):
        raise ValueError(f"expected a whole number of bytes, got {text!r}")
    size = int(float(match.group(1)) * unit)  # digits only (the pattern): never NaN or infinite
    if size > MAX_SIZE:
        raise ValueError(f"{text!r} is larger than any disk (at most {format_size(MAX_SIZE)})")
    return size


# A rate as rsync's and rclone's --bwlimit read it: a bare number is KiB/s in both; K/M/G/T are
# binary in both (rclone also writes Ki/Mi, rsync KiB/MiB); KB/MB/GB/TB are decimal (rsync's
# reading; rclone refuses them); B is bytes. Zero (rsync) and "off" (rclone) mean no limit.
_RATE_UNITS = {
    "": 1024,
    "b": 1,
    **{f"{p}{tail}": 1024**n for n, p in enumerate("kmgt", 1) for tail in ("", "i", "ib")},
    **{f"{p}b": 1000**n for n, p in enumerate("kmgt", 1)},
}
_RATE = re.compile(r"^(\d+(?:\.\d+)?)([a-zA-Z]*)$")
MIN_RATE = 512  # bytes/s: rsync's floor for --bwlimit; below it a run of real weights never ends
RATE_GRAMMAR = ("a number of KiB/s, or with a unit: B, K/Ki/KiB, M/Mi/MiB, G/Gi/GiB, T/Ti/TiB (x1024), "
                "KB, MB, GB, TB (x1000); 0 or off for no limit")


def parse_rate(text: str) -> int | None:
    """Bytes per second for a --bwlimit value ("50M" = 50 MiB/s, "800" = 800 KiB/s, "50MB" =
    50,000,000 B/s), or None for no limit ("0", "off"). Raises ValueError naming the grammar.

    Refused, rather than guessed: rclone's timetables ("08:00,512k") and upload:download pairs
    ("10M:1M"), rsync's "+1"/"-1" offsets, "/s" suffixes, exponents, NaN, and rates below 512 B/s."""
    spelled = text.strip()
    if spelled.lower() == "off":
        return None
    match = _RATE.match(spelled)
    if not match or match.group(2).lower() not in _RATE_UNITS:
        raise ValueError(f"{text!r} is not a rate: expected {RATE_GRAMMAR}")
    rate = int(float(match.group(1)) * _RATE_UNITS[match.group(2).lower()])  # digits only: finite
    if rate == 0 and float(match.group(1)) == 0:
        return None
    if rate < MIN_RATE:
        raise ValueError(f"{text!r} is below the smallest rate, {MIN_RATE} B/s (0 or off: no limit)")
    if rate > MAX_SIZE:
        raise ValueError(f"{text!r} is larger than any link (at most {format_size(MAX_SIZE)}/s)")
    return rate


_SECONDS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^\s*(\d+)\s*([smhd]?)\s*$")


def parse_duration(text: str | int) -> int:
    """Parse "6h", "90m", "2d", "45s" or a whole number of seconds into seconds. Raises ValueError.

    Whole units only: a duration is a threshold an operator compares with log times, and a
    fraction ("1.5h") or a float (`= 1e999`, nan) has no exact meaning there."""
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ValueError(f"expected a duration like '6h', '90m' or a whole number of seconds, got {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError("a duration cannot be negative")
        return text
    match = _DURATION.match(text)
    if not match:
        raise ValueError(f"expected a duration like '6h', '90m', '2d' or '45s', got {text!r}")
    return int(match.group(1)) * _SECONDS[match.group(2)]


def format_size(n: int) -> str:
    """Binary units with two decimals: the figures operators compare with `df -h`."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def parse_number(text: str | int | float, kind: type = float, low: float | None = None,
                 high: float | None = None) -> int | float:
    """`text` as a finite `kind` (int or float) in [low, high]. Raises ValueError with the reason.

    NaN compares false with every bound, so `--wait nan` passed `min=0` and waited for ever, as
    did `inf`: neither is a number of anything here."""
    try:
        value = kind(text)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"{text!r} is not a {'whole number' if kind is int else 'number'}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"{'' if low is None else f'{low:g}<='}x{'' if high is None else f'<={high:g}'}"
        raise ValueError(f"{text} is not in the range {bounds}")
    return value
