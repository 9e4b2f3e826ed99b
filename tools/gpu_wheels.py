#!/usr/bin/env python3
"""flash-attn-4 (FA4) as wheel files for a GPU machine without network (docs/gpu.md).

Standard library only: ``python3 tools/gpu_wheels.py install ...`` runs on the GPU machine from a
source checkout, before anything else is installed there.

Here (network):   ``make gpu-wheels PY=3.12 CUDA=13`` runs ``download``: ``pip download
--only-binary=:all: --no-deps`` of an explicit list (never torch) for one Python version and one
CUDA major (13 for torch ``+cu130``, 12 otherwise) into ``gpu-wheels/py312-cu13/``, splits every file
over 60 MiB into equal parts, deals wheels and parts into ``transfer-1/``, ``transfer-2/``, ... of at
most 56 MiB each (a device call carries 64 MiB with the working tree) and writes ``manifest.json``
(every file's name, size and sha256, and each part's) into each transfer folder.

There (no network): ``install`` joins the parts, checks every sha256 (a corrupt or missing part is
refused by name), runs ``pip install --no-index --no-deps --target DIR`` and imports
``flash_attn.cute`` with the PYTHONPATH it prints. The wheels marked ``if_missing`` (FA4's
dependencies that a torch machine often has: cuda-bindings, protobuf, einops, typing-extensions) are installed only
where the machine's Python cannot import them already.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

MiB = 1 << 20
SPLIT_MIB = 60  # files over this are split into parts
TRANSFER_MIB = 56  # what one transfer folder holds (a device call: 64 MiB with the working tree)
MANIFEST = "manifest.json"

#: the FA4 set (flash-attn-4 4.0.0b36 and what its metadata requires, torch aside). nvidia-cutlass-dsl
#: requires -libs-cu12 unconditionally and -libs-cu13 with its [cu13] extra: with --no-deps only the
#: one for the CUDA major is taken (a cu130 torch wants -libs-cu13).
FA4 = [
    "flash-attn-4==4.0.0b36",
    "nvidia-cutlass-dsl==4.8.1",
    "nvidia-cutlass-dsl-libs-base==4.8.1",
    "nvidia-cutlass-dsl-libs-core==4.8.1",
    "nvidia-cutlass-dsl-libs-cu{cuda}==4.8.1",
    "quack-kernels==0.6.5",
    "apache-tvm-ffi==0.1.15.post2",
    "torch-c-dlpack-ext==0.1.5",
]
#: required by the set above, often present beside torch: installed only where the import fails
IF_MISSING = {
    "cuda-bindings{cuda_bindings}": "cuda.bindings",
    "cuda-pathfinder>=1.4.2": "cuda.pathfinder",
    "protobuf>=4.21.12": "google.protobuf",
    "einops==0.8.2": "einops",
    "typing-extensions>=4.13": "typing_extensions",
}
CUDA_BINDINGS = {"12": ">=12.8,<13", "13": ">=13,<14"}
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64"]


def tag(python: str, cuda: str) -> str:
    return f"py{python.replace('.', '')}-cu{cuda}"


def requirements(cuda: str) -> tuple[list[str], dict[str, str]]:
    """(the FA4 set, {requirement: import name} of the if-missing ones) for a CUDA major."""
    if cuda not in CUDA_BINDINGS:
        raise SystemExit(f"CUDA major {cuda!r}: 12 or 13 (13 for torch +cu130, 12 for +cu12x)")
    fa4 = [r.format(cuda=cuda) for r in FA4]
    extra = {r.format(cuda_bindings=CUDA_BINDINGS[cuda]): mod for r, mod in IF_MISSING.items()}
    return fa4, extra


def download_command(python: str, cuda: str, dest: str, pip: list[str] | None = None) -> list[str]:
    """The ``pip download`` command line for one Python version and CUDA major (no torch, no deps)."""
    fa4, extra = requirements(cuda)
    cmd = list(pip or [sys.executable, "-m", "pip"]) + [
        "download", "--only-binary=:all:", "--no-deps", "--implementation", "cp",
        "--python-version", python, "-d", dest]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    return cmd + fa4 + list(extra)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist_name(filename: str) -> str:
    """A wheel file's distribution name, normalised (its name has no '-': PEP 427)."""
    return _norm(filename.split("-")[0])


def pack(src: str, out: str, split_mib: float = SPLIT_MIB, transfer_mib: float = TRANSFER_MIB,
         if_missing: dict[str, str] | None = None) -> dict:
    """Split the files of ``src`` over ``split_mib`` into equal parts, deal files and parts into
    ``out/transfer-K`` folders of at most ``transfer_mib`` (first fit, largest first) and write the
    manifest into each. ``if_missing``: {distribution name: import name}."""
    split, budget = int(split_mib * MiB), int(transfer_mib * MiB)
    by_dist = {_norm(re.match(r"[A-Za-z0-9._-]+", k).group()): v for k, v in (if_missing or {}).items()}
    files, pieces = [], []  # pieces: (size, name, source path, offset)
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if not os.path.isfile(path) or name == MANIFEST:
            continue
        size = os.path.getsize(path)
        entry = {"name": name, "size": size, "sha256": sha256(path), "parts": []}
        if _dist_name(name) in by_dist:
            entry["if_missing"] = by_dist[_dist_name(name)]
        if size > split:
            n = math.ceil(size / min(split, budget))  # equal parts, each fitting a transfer
            step = math.ceil(size / n)
            for k in range(n):
                off = k * step
                pieces.append((min(step, size - off), f"{name}.part{k + 1}of{n}", path, off))
        else:
            pieces.append((size, name, path, 0))
        files.append(entry)
    transfers: list[list] = []
    loads: list[int] = []
    for piece in sorted(pieces, key=lambda p: (-p[0], p[1])):
        for k, load in enumerate(loads):
            if load + piece[0] <= budget:
                break
        else:
            k = len(loads)
            transfers.append([])
            loads.append(0)
        transfers[k].append(piece)
        loads[k] += piece[0]
    if os.path.isdir(out):
        for name in os.listdir(out):
            if name.startswith("transfer-"):
                shutil.rmtree(os.path.join(out, name))
    os.makedirs(out, exist_ok=True)
    where = {}
    for k, group in enumerate(transfers, 1):
        folder = os.path.join(out, f"transfer-{k}")
        os.makedirs(folder)
        for size, name, path, off in group:
            target = os.path.join(folder, name)
            if name == os.path.basename(path):
                shutil.copyfile(path, target)
            else:
                with open(path, "rb") as f, open(target, "wb") as g:
                    f.seek(off)
                    g.write(f.read(size))
            where[name] = (f"transfer-{k}", size, sha256(target))
    for entry in files:
        names = sorted((n for n in where if n.startswith(entry["name"] + ".part")),
                       key=lambda n: int(n.rsplit(".part", 1)[1].split("of")[0]))
        entry["parts"] = [{"name": n, "transfer": where[n][0], "size": where[n][1], "sha256": where[n][2]}
                          for n in names]
        if not names:
            entry["transfer"] = where[entry["name"]][0]
    manifest = {"split_mib": split_mib, "transfer_mib": transfer_mib,
                "transfers": {f"transfer-{k}": loads[k - 1] for k in range(1, len(transfers) + 1)},
                "files": files}
    for k in range(1, len(transfers) + 1):
        with open(os.path.join(out, f"transfer-{k}", MANIFEST), "w") as f:
            json.dump(manifest, f, indent=1)
    return manifest


def read_manifest(root: str) -> dict:
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name, MANIFEST)
        if name.startswith("transfer-") and os.path.isfile(path):
            with open(path) as f:
                return json.load(f)
    raise SystemExit(f"no transfer-*/{MANIFEST} under {root}: carry the transfer folders here first")


def join(root: str, dest: str) -> list[dict]:
    """Rebuild every file of the manifest into ``dest`` (a part's and the whole file's sha256
    checked); a missing or corrupt piece raises SystemExit naming it. Returns the manifest's files."""
    manifest = read_manifest(root)
    os.makedirs(dest, exist_ok=True)
    bad = []
    for entry in manifest["files"]:
        target = os.path.join(dest, entry["name"])
        pieces = entry["parts"] or [{"name": entry["name"], "transfer": entry["transfer"], "size": entry["size"],
                                     "sha256": entry["sha256"]}]
        ok = True
        with open(target, "wb") as g:
            for part in pieces:
                path = os.path.join(root, part["transfer"], part["name"])
                if not os.path.isfile(path):
                    bad.append(f"{part['transfer']}/{part['name']}: missing (not carried yet?)")
                    ok = False
                elif os.path.getsize(path) != part["size"] or sha256(path) != part["sha256"]:
                    bad.append(f"{part['transfer']}/{part['name']}: sha256 or size differs from the manifest")
                    ok = False
                elif ok:
                    with open(path, "rb") as f:
                        shutil.copyfileobj(f, g, MiB)
        if ok and (os.path.getsize(target) != entry["size"] or sha256(target) != entry["sha256"]):
            bad.append(f"{entry['name']} (joined): sha256 or size differs from the manifest")
    if bad:
        raise SystemExit("refused, nothing installed:\n  " + "\n  ".join(bad))
    return manifest["files"]


def importable(python: str, module: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    try:
        return subprocess.run([python, "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def pythonpath(target: str) -> str:
    # nvidia-cutlass-dsl puts its packages on sys.path with a .pth file, which a PYTHONPATH folder
    # does not run: its dsl_packages folder goes on the path too
    target = os.path.abspath(target)
    return os.pathsep.join([target, os.path.join(target, "nvidia_cutlass_dsl", "dsl_packages")])


def install(root: str, target: str, python: str = sys.executable, check: str = "flash_attn.cute") -> int:
    with tempfile.TemporaryDirectory(prefix="gpu-wheels-") as tmp:
        files = join(root, tmp)
        wheels, skipped = [], []
        for entry in files:
            mod = entry.get("if_missing")
            if mod and importable(python, mod):
                skipped.append(f"{entry['name']} ({mod} already importable)")
            else:
                wheels.append(os.path.join(tmp, entry["name"]))
        for s in skipped:
            print("skipped", s)
        cmd = [python, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
               "--upgrade", "--target", target] + wheels
        print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
        rc = subprocess.run(cmd).returncode
        if rc:
            return rc
    line = pythonpath(target)
    print(f"export PYTHONPATH={line}${{PYTHONPATH:+:$PYTHONPATH}}")
    if check:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [line, os.environ.get("PYTHONPATH")])))
        code = (f"import importlib.metadata as m, {check} as x; "
                "print('imported', x.__name__, 'from', x.__file__, '| flash-attn-4', m.version('flash-attn-4'))")
        rc = subprocess.run([python, "-c", code], env=env).returncode
        if rc:
            print(f"import {check} failed with that PYTHONPATH", file=sys.stderr)
        return rc
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("download", help="pip download the FA4 set, then split and deal into transfers")
    d.add_argument("--python", default="3.12", help="Python version of the GPU machine (3.12)")
    d.add_argument("--cuda", default="13", help="CUDA major of its torch: 13 for +cu130, 12 otherwise")
    d.add_argument("--out", default="gpu-wheels", help="folder; the set goes to OUT/py312-cu13 etc.")
    d.add_argument("--split-mib", type=float, default=SPLIT_MIB)
    d.add_argument("--transfer-mib", type=float, default=TRANSFER_MIB)
    d.add_argument("--dry-run", action="store_true", help="print the pip command only")
    k = sub.add_parser("pack", help="split and deal an existing folder of wheels into transfers")
    k.add_argument("src")
    k.add_argument("out")
    k.add_argument("--split-mib", type=float, default=SPLIT_MIB)
    k.add_argument("--transfer-mib", type=float, default=TRANSFER_MIB)
    v = sub.add_parser("verify", help="join and check every sha256, install nothing")
    v.add_argument("root", help="the folder holding transfer-1/, transfer-2/, ...")
    i = sub.add_parser("install", help="join, check, pip install --no-index --no-deps --target, import FA4")
    i.add_argument("root", help="the folder holding transfer-1/, transfer-2/, ...")
    i.add_argument("--target", default=None, help="install folder (default ROOT/site)")
    i.add_argument("--python", default=sys.executable, help="the Python that will import FA4")
    i.add_argument("--check", default="flash_attn.cute", help="module imported at the end ('' for none)")
    a = p.parse_args(argv)
    if a.cmd == "download":
        out = os.path.join(a.out, tag(a.python, a.cuda))
        raw = os.path.join(out, "download")
        cmd = download_command(a.python, a.cuda, raw)
        print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
        if a.dry_run:
            return 0
        os.makedirs(raw, exist_ok=True)
        rc = subprocess.run(cmd).returncode
        if rc:
            return rc
        _, extra = requirements(a.cuda)
        m = pack(raw, out, a.split_mib, a.transfer_mib, extra)
    elif a.cmd == "pack":
        m = pack(a.src, a.out, a.split_mib, a.transfer_mib, requirements("13")[1])
        out = a.out
    elif a.cmd == "verify":
        with tempfile.TemporaryDirectory(prefix="gpu-wheels-verify-") as tmp:
            for entry in join(a.root, tmp):
                print("ok", entry["name"], entry["size"])
        return 0
    else:
        return install(a.root, a.target or os.path.join(a.root, "site"), a.python, a.check)
    for name, size in m["transfers"].items():
        print(f"{os.path.join(out, name)}: {size / MiB:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
