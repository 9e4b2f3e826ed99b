"""Imported once by the gloo ranks' fork server (:func:`dist_helper.start_fork_server`): the modules
named in ``$STRIPED_SP_TEST_PRELOAD`` (comma-separated), so that every rank of every ``run_cases``
forks with torch and the frameworks already imported instead of importing them again (several
seconds of CPU per rank).  A module that fails to import is left to the rank, which then imports
it itself and reports what goes wrong there."""

import importlib
import os
import sys


def _preload(names: str) -> None:
    saved = [os.dup(1), os.dup(2)]  # the imports' warnings and log lines: not onto the terminal
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    os.close(quiet)
    try:
        for name in filter(None, names.split(",")):
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the rank imports it again and reports
                pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for stream, fd in zip((1, 2), saved):
            os.dup2(fd, stream)
            os.close(fd)


_preload(os.environ.get("STRIPED_SP_TEST_PRELOAD", "torch,torch.distributed,striped_sp"))
