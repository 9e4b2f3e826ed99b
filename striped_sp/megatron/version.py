"""Which megatron-core releases the adapter supports, and the check that ``install()`` runs.

Tested: megatron-core 0.16.1, 0.17.1, 0.18.2 and 0.19.x (with the Megatron-LM tags core_v0.16.1,
core_v0.17.1, core_v0.18.2 and core_v0.19.0; ``patches/`` has one patch per release line).  The
hooks pick what to patch by feature detection, so a release outside the range may work, but it
has not been tested: ``install()`` refuses it by name unless ``STRIPED_SP_ALLOW_UNTESTED_MEGATRON=1``.
"""

from __future__ import annotations

import os
import warnings

__all__ = ["SUPPORTED_LINES", "TESTED_RELEASES", "megatron_core_version", "megatron_core_line", "check_supported",
           "ALLOW_ENV"]

#: release lines (major, minor) the adapter is tested on
SUPPORTED_LINES = ((0, 16), (0, 17), (0, 18), (0, 19))
#: the exact releases the tests run against
TESTED_RELEASES = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
ALLOW_ENV = "STRIPED_SP_ALLOW_UNTESTED_MEGATRON"


def megatron_core_version() -> str:
    """The installed megatron-core version string (``ValueError`` if megatron-core is absent)."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("megatron-core")
    except PackageNotFoundError:
        pass
    try:
        from megatron.core import package_info

        return package_info.__version__
    except ImportError:
        raise ValueError("megatron-core is not installed: pip install 'striped_sp[megatron]'") from None


def megatron_core_line() -> tuple[int, int]:
    """The installed megatron-core's release line, ``(major, minor)``."""
    return _line(megatron_core_version())


def _line(text: str) -> tuple[int, int]:
    parts = text.split("+")[0].split(".")
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except (IndexError, ValueError):
        return (-1, -1)


def check_supported(found: str | None = None) -> str:
    """``found`` (default: the installed version) if its release line is supported; else a
    ``ValueError`` naming the version, the range and the override (which turns it into a warning)."""
    found = megatron_core_version() if found is None else found
    if _line(found) in SUPPORTED_LINES:
        return found
    lines = ", ".join(f"{a}.{b}" for a, b in SUPPORTED_LINES)
    message = (f"megatron-core {found} is outside the range striped_sp is tested with ({lines}; releases "
               f"{', '.join(TESTED_RELEASES)})")
    if os.environ.get(ALLOW_ENV, "0") not in ("", "0"):
        warnings.warn(f"{message}; going on because {ALLOW_ENV} is set", stacklevel=2)
        return found
    raise ValueError(f"{message}: install one of those, or set {ALLOW_ENV}=1 to try anyway")
