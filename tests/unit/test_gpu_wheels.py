"""tools/gpu_wheels.py (FA4 wheels for a GPU machine without network): split, deal into transfers,
manifest, join and sha256 checks on small fake files with a tiny threshold (no network); a corrupt or
missing part refused by name; the pip download command `make gpu-wheels` would run, per Python and
CUDA major; the tool imports nothing but the standard library."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "gpu_wheels.py")
KiB = 1024


def _load():
    spec = importlib.util.spec_from_file_location("gpu_wheels", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gw = _load()


def _fake_wheels(folder, sizes):
    os.makedirs(folder, exist_ok=True)
    out = {}
    for name, size in sizes.items():
        data = hashlib.sha256(name.encode()).digest() * (size // 32 + 1)
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data[:size])
        out[name] = data[:size]
    return out


SIZES = {
    "nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl": 92 * KiB,  # "92 MB"
    "flash_attn_4-4.0.0b36-py3-none-any.whl": 2 * KiB,
    "quack_kernels-0.6.5-py3-none-any.whl": 3 * KiB,
    "cuda_bindings-13.5.0-cp312-cp312-manylinux_2_28_x86_64.whl": 8 * KiB,
    "einops-0.8.2-py3-none-any.whl": 1 * KiB,
}


def _pack(tmp_path):
    src = tmp_path / "download"
    data = _fake_wheels(str(src), SIZES)
    # 60 KiB split threshold and 56 KiB transfers: the 92 KiB file in two parts, as 92 MB in MiB
    m = gw.pack(str(src), str(tmp_path / "set"), split_mib=60 / 1024, transfer_mib=56 / 1024,
                if_missing={"cuda-bindings>=13,<14": "cuda.bindings", "einops==0.8.2": "einops"})
    return data, m


def test_split_deal_manifest_and_join(tmp_path):
    data, m = _pack(tmp_path)
    root = tmp_path / "set"
    big = next(e for e in m["files"] if e["name"].startswith("nvidia_cutlass_dsl_libs_cu13"))
    assert [p["name"] for p in big["parts"]] == [big["name"] + ".part1of2", big["name"] + ".part2of2"]
    assert sum(p["size"] for p in big["parts"]) == big["size"] == 92 * KiB
    assert all(p["size"] <= 56 * KiB for p in big["parts"])
    # small files are not split; every piece in exactly one transfer, each within its budget
    assert all(not e["parts"] for e in m["files"] if e is not big)
    assert sorted(m["transfers"]) == ["transfer-1", "transfer-2"]
    for name, load in m["transfers"].items():
        files = [f for f in os.listdir(root / name) if f != "manifest.json"]
        assert sum(os.path.getsize(root / name / f) for f in files) == load <= 56 * KiB
        with open(root / name / "manifest.json") as f:
            assert json.load(f) == m  # the same manifest in each transfer
    # the manifest: names, sizes, sha256 of whole files and of parts; the if-missing marks
    for e in m["files"]:
        assert e["size"] == SIZES[e["name"]]
        assert e["sha256"] == hashlib.sha256(data[e["name"]]).hexdigest()
        for p in e["parts"]:
            assert p["sha256"] == gw.sha256(str(root / p["transfer"] / p["name"]))
    marks = {e["name"].split("-")[0]: e.get("if_missing") for e in m["files"]}
    assert marks == {"nvidia_cutlass_dsl_libs_cu13": None, "flash_attn_4": None, "quack_kernels": None,
                     "cuda_bindings": "cuda.bindings", "einops": "einops"}
    out = tmp_path / "joined"
    gw.join(str(root), str(out))
    for name, blob in data.items():
        assert (out / name).read_bytes() == blob


def test_a_corrupt_or_missing_part_is_refused_by_name(tmp_path):
    _, m = _pack(tmp_path)
    root = tmp_path / "set"
    big = next(e for e in m["files"] if e["parts"])
    second = big["parts"][1]
    path = root / second["transfer"] / second["name"]
    blob = bytearray(path.read_bytes())
    blob[100] ^= 1
    path.write_bytes(bytes(blob))
    with pytest.raises(SystemExit, match=r"(?s)refused.*" + second["name"].replace(".", r"\.") + ": sha256"):
        gw.join(str(root), str(tmp_path / "j1"))
    path.unlink()
    with pytest.raises(SystemExit, match=r"part2of2: missing"):
        gw.join(str(root), str(tmp_path / "j2"))
    # the command line says the same and exits non-zero
    r = subprocess.run([sys.executable, TOOL, "verify", str(root)], capture_output=True, text=True)
    assert r.returncode != 0 and "part2of2: missing" in r.stderr


def test_the_joined_file_is_checked_as_a_whole(tmp_path):
    _, m = _pack(tmp_path)
    root = tmp_path / "set"
    for name in m["transfers"]:
        with open(root / name / "manifest.json") as f:
            doc = json.load(f)
        for e in doc["files"]:
            if e["parts"]:
                e["sha256"] = "0" * 64
        with open(root / name / "manifest.json", "w") as f:
            json.dump(doc, f)
    with pytest.raises(SystemExit, match=r"nvidia_cutlass_dsl_libs_cu13.*\(joined\): sha256"):
        gw.join(str(root), str(tmp_path / "j"))


@pytest.mark.parametrize("py,cuda", [("3.12", "13"), ("3.11", "12")])
def test_make_gpu_wheels_dry_run(py, cuda):
    r = subprocess.run(["make", "-s", "gpu-wheels", f"PYVER={py}", f"CUDA={cuda}", "DRY_RUN=1",
                        f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("+ "))
    args = line.split()
    assert "download" in args and "--no-deps" in args and "--only-binary=:all:" in args
    assert args[args.index("--python-version") + 1] == py
    assert "manylinux_2_28_x86_64" in args and all(a.endswith("x86_64") for a, b in
                                                    zip(args[1:], args) if b == "--platform")
    assert args[args.index("-d") + 1] == f"gpu-wheels/py{py.replace('.', '')}-cu{cuda}/download"
    names = [a.strip("'") for a in args if "==" in a or ">=" in a]
    assert f"nvidia-cutlass-dsl-libs-cu{cuda}==4.8.1" in names
    assert f"nvidia-cutlass-dsl-libs-cu{25 - int(cuda)}==4.8.1" not in names  # not the other major's
    assert "flash-attn-4==4.0.0b36" in names and not any(n.startswith("torch==") or n == "torch" for n in args)
    assert f"cuda-bindings>={'13,<14' if cuda == '13' else '12.8,<13'}" in names
    for need in ("nvidia-cutlass-dsl==", "nvidia-cutlass-dsl-libs-base==", "nvidia-cutlass-dsl-libs-core==",
                 "quack-kernels==", "apache-tvm-ffi==", "torch-c-dlpack-ext=="):
        assert any(n.startswith(need) for n in names), need


def test_the_tool_is_standard_library_only():
    tree = ast.parse(open(TOOL).read())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}, mods


def test_pythonpath_holds_the_cutlass_dsl_packages_folder():
    # nvidia-cutlass-dsl adds nvidia_cutlass_dsl/dsl_packages with a .pth file, not run from PYTHONPATH
    assert gw.pythonpath("/x/site").split(os.pathsep) == ["/x/site", "/x/site/nvidia_cutlass_dsl/dsl_packages"]


def test_the_fa4_extras_per_cuda_major():
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    extras = {k: [ln.strip() for ln in v.strip().splitlines()] for k, v in cfg["options.extras_require"].items()}
    # nvidia-cutlass-dsl's default flavour is cu12; torch +cu130 needs flash-attn-4's cu13 extra
    assert extras["fa4"] == ["flash-attn-4>=4.0.0b5,<4.1"]
    assert extras["fa4-cu13"] == ["flash-attn-4[cu13]>=4.0.0b5,<4.1"]
