"""Byte counts for people: GiB for device-sized numbers, MiB or KiB for small models."""

GIB = 2 ** 30


def human_bytes(count: float) -> str:
    for unit, size in (("GiB", GIB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} bytes"
