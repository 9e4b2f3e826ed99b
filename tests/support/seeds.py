"""Test seeds: fixed by default, reproducible by name, overridable from the environment.

Every seed is ``(base + crc32(name)) mod 2**31``: ``name`` is a pytest node id or a test module's
name, ``base`` is ``$STRIPED_SP_TEST_SEED`` (default 0; ``random`` draws a fresh base, printed
with any failure).  ``zlib.crc32`` and not ``hash()``: Python salts ``hash()`` of a string per
process, so a seed from it changes on every run and differs between spawned ranks.
"""

from __future__ import annotations

import os
import random
import zlib

ENV = "STRIPED_SP_TEST_SEED"


def _base() -> int:
    raw = os.environ.get(ENV, "0").strip()
    if raw == "random":
        # spawned ranks re-import this module: fix the drawn base for them through the environment
        os.environ[ENV] = raw = str(random.SystemRandom().randrange(2**31))
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${ENV}={raw!r} must be an integer or 'random'") from None


BASE = _base()


def seed_for(name: str) -> int:
    """The seed of ``name`` (a node id, a module name, a case name): stable across runs."""
    return (BASE + zlib.crc32(name.encode())) % 2**31


def how_to_reproduce(seed: int) -> str:
    return f"seed {seed}: rerun with {ENV}={BASE} to reproduce (or {ENV}=random for new inputs)"
