"""Where things are, for tests in any folder of tests/: the repository root, tests/ and this folder."""

import pathlib

SUPPORT = pathlib.Path(__file__).resolve().parent
TESTS = SUPPORT.parent
ROOT = TESTS.parent
