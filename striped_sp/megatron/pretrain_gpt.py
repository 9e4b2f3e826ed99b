"""Run Megatron-LM's unmodified pretrain_gpt.py with ``--context-parallel-algo`` (no patch needed).

    export MEGATRON_LM_DIR=/path/to/Megatron-LM        # a checkout at core_v0.16.1 .. core_v0.19.x
    torchrun --nproc-per-node 8 -m striped_sp.megatron.pretrain_gpt \\
        <pretrain_gpt.py arguments> --context-parallel-size 8 --context-parallel-algo striped

Megatron-LM is found through ``MEGATRON_LM_DIR`` or ``--megatron-lm-dir DIR`` (first
argument), else the current directory.  Before pretrain_gpt.py runs, Megatron's argument
parsing gets our flag chained to its own ``extra_args_provider``, and its argument validation
also runs :func:`striped_sp.megatron.validate_args` and then :func:`striped_sp.megatron.install`
with the chosen algo, so RoPE, batch slicing, the layer specs and MTP follow the layout.
Megatron's own check that ``--seq-length`` is a multiple of 2 * CP still applies on this route.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Optional

from .arguments import DEFAULT_ALGO, add_arguments, algo_of, chain_providers, note_layout, validate_args
from .hooks import install

__all__ = ["find_megatron_lm", "hook_initialize", "hook_megatron_arguments", "print_help", "main"]


def find_megatron_lm(path: Optional[str] = None) -> str:
    """The Megatron-LM checkout holding pretrain_gpt.py: ``path``, ``$MEGATRON_LM_DIR`` or cwd."""
    for candidate in (path, os.environ.get("MEGATRON_LM_DIR"), os.getcwd()):
        if candidate and os.path.isfile(os.path.join(candidate, "pretrain_gpt.py")):
            return os.path.abspath(candidate)
    raise ValueError(
        "cannot find Megatron-LM's pretrain_gpt.py: set MEGATRON_LM_DIR to a Megatron-LM checkout "
        "(tags core_v0.16.1 to core_v0.19.x), pass --megatron-lm-dir DIR first, or run from that directory"
    )


def hook_initialize(module) -> None:
    """Wrap ``module.parse_args`` and ``module.validate_args`` so that our flag is parsed,
    checked and installed.  ``module`` is ``megatron.training.arguments`` (whose
    ``parse_and_validate_args`` calls them, megatron-core >= 0.18) or
    ``megatron.training.initialize`` (which imported them by name, up to 0.17)."""
    parse = getattr(module, "parse_args", None)
    validate = getattr(module, "validate_args", None)
    if parse is None or validate is None or getattr(parse, "__striped_sp_original__", None) is not None:
        return  # not there, or already hooked

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        args = parse(chain_providers(extra_args_provider, add_arguments), ignore_unknown_args)
        algo = getattr(args, "context_parallel_algo", DEFAULT_ALGO)
        if getattr(args, "yaml_cfg", None) and algo != DEFAULT_ALGO:
            # Megatron then calls validate_yaml instead of validate_args: nothing would install.
            raise ValueError(
                f"--context-parallel-algo {algo} on this no-patch route does not work with --yaml-cfg: "
                "pass the settings as command-line flags, or apply the patch in patches/"
            )
        return args

    def validate_args(args, *rest, **kwargs):
        note_layout(args)  # before Megatron's argument dump, which validate prints
        out = validate(args, *rest, **kwargs)
        _check_and_install(args)
        return out

    parse_args.__striped_sp_original__ = parse
    validate_args.__striped_sp_original__ = validate
    module.parse_args = parse_args
    module.validate_args = validate_args


def hook_megatron_arguments() -> None:
    """Hook Megatron-LM's argument parsing wherever this release keeps it."""
    import importlib

    for name in ("megatron.training.arguments", "megatron.training.initialize"):
        try:
            hook_initialize(importlib.import_module(name))
        except ImportError:
            continue


def _check_and_install(args) -> None:
    validate_args(args)
    algo = algo_of(args)  # with --striped-stripe-size / --striped-doc-placement: the layout key
    if algo != DEFAULT_ALGO:
        install(algo)


def print_help(path: Optional[str] = None) -> None:
    """``--help``: this entry's usage and the plugin's flags, from the plugin's own parser (nothing of
    Megatron imported: its training modules need GPU-only packages such as triton), then Megatron-LM's
    own flags where its checkout imports here."""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m striped_sp.megatron.pretrain_gpt", add_help=False,
        usage="%(prog)s [--megatron-lm-dir DIR] <pretrain_gpt.py arguments> --context-parallel-algo ALGO",
        description=__doc__.split("\n\n")[0] + " The plugin's flags (Megatron-LM's own follow, where its "
                    "checkout and dependencies are at hand):")
    add_arguments(parser)
    parser.print_help()
    sys.stdout.flush()
    try:
        root = find_megatron_lm(path)
    except ValueError as exc:
        print(f"\nMegatron-LM's own flags: not shown ({exc})")
        return
    if root not in sys.path:
        sys.path.insert(0, root)
    print(f"\nMegatron-LM's own flags ({root}):", flush=True)
    import warnings

    try:
        with warnings.catch_warnings():  # its imports warn about every optional GPU package
            warnings.simplefilter("ignore")
            hook_megatron_arguments()
            sys.argv = [os.path.join(root, "pretrain_gpt.py"), "--help"]
            runpy.run_path(sys.argv[0], run_name="__main__")
    except ImportError as exc:  # e.g. triton on a machine without a GPU
        print(f"  not shown: its modules do not import here ({type(exc).__name__}: {exc})")


def main(argv: Optional[list] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    path = None
    if argv[:1] == ["--megatron-lm-dir"]:
        if len(argv) < 2:
            raise SystemExit("--megatron-lm-dir needs a directory")
        path, argv = argv[1], argv[2:]
    if "-h" in argv or "--help" in argv:
        print_help(path)
        return
    try:
        root = find_megatron_lm(path)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if root not in sys.path:
        sys.path.insert(0, root)
    hook_megatron_arguments()
    script = os.path.join(root, "pretrain_gpt.py")
    sys.argv = [script] + argv
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
