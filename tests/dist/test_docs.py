"""Docs that cannot rot: what README.md and docs/*.md show must exist.

Parsed from every page (fenced code blocks and inline code spans):

* shell commands: every ``striped-sp ...`` command parses with :func:`striped_sp.cli.build_parser`
  (its sub-commands and flags exist; without shell variables or placeholders the whole command
  line parses, values included); ``make`` targets exist in the Makefile; ``python -m striped_sp...``
  modules exist; scripts of this repository exist and know the flags shown; ``pip install`` extras
  exist in setup.cfg; Megatron-LM patch files exist;
* Megatron flags: a flag of the plugin's namespace (``--context-parallel-algo``, ``--striped-*``,
  ``--context-parallel-timeout-s``) is known to the plugin's own parser
  (:func:`striped_sp.megatron.add_arguments` on a fresh ``argparse`` parser); any other flag is
  known to Megatron-LM's parser where a Megatron-LM checkout is at hand (``../shared/megatron-lm``),
  or to this repository's command lines and scripts;
* DeepSpeed JSON: every ``context_parallel`` section parses with
  :func:`striped_sp.deepspeed.parse_config`, and every ``context_parallel.KEY`` named is a key;
* Python: every block compiles; every ``striped_sp`` module, name and attribute it imports or uses
  exists (also ``striped_sp.x.y`` names in inline code);
* links and paths: relative links (and their ``#anchors``) and repository paths in inline code
  point to files that exist; ``STRIPED_SP_*`` environment variables are read by the package.

Cheap examples run: the README quick start on 2 gloo ranks, the results command's work-model
section, and the Megatron MLA route of docs/megatron.md without Transformer Engine.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import dataclasses
import functools
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLUGIN_PREFIXES = ("--striped-", "--context-parallel-algo", "--context-parallel-timeout")
#: flags of third-party launchers and tools the docs show next to ours
OTHER_TOOLS_FLAGS = {"--nproc-per-node", "--nproc_per_node", "--nnodes", "--no-build-isolation", "--check",
                     "--deepspeed", "--help", "-q", "-e", "--list", "--quiet"}


# ------------------------------------------------------------------------------ parsing the pages

@dataclasses.dataclass(frozen=True)
class Snippet:
    page: Path
    line: int
    lang: str  # a fenced block's language, or "inline" for a code span
    text: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def _parse(page: Path) -> tuple[list[Snippet], list[Snippet], list[tuple[int, str]]]:
    """(fenced blocks, inline code spans, prose lines with their numbers) of one page."""
    blocks, spans, prose = [], [], []
    lines = page.read_text().splitlines()
    i = 0
    para: list[tuple[int, str]] = []

    def flush():
        if not para:
            return
        text = "\n".join(t for _, t in para)
        starts = [0]
        for _, t in para:
            starts.append(starts[-1] + len(t) + 1)
        for m in re.finditer(r"(`+)(.+?)\1", text, re.S):
            line = para[max(k for k, s in enumerate(starts[:-1]) if s <= m.start())][0]
            spans.append(Snippet(page, line, "inline", " ".join(m.group(2).split())))
        para.clear()

    while i < len(lines):
        m = re.match(r"^\s*```\s*([\w+-]*)\s*$", lines[i])
        if m:
            flush()
            start, lang, body = i + 1, m.group(1).lower(), []
            i += 1
            while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
                body.append(lines[i])
                i += 1
            indent = min((len(b) - len(b.lstrip()) for b in body if b.strip()), default=0)
            blocks.append(Snippet(page, start + 1, lang, "\n".join(b[indent:] for b in body)))
        elif not lines[i].strip():
            flush()
        else:
            para.append((i + 1, lines[i]))
            prose.append((i + 1, lines[i]))
        i += 1
    flush()
    return blocks, spans, prose


@functools.lru_cache(maxsize=None)
def _all() -> tuple[list[Snippet], list[Snippet], list[tuple[Path, int, str]]]:
    blocks, spans, prose = [], [], []
    for page in PAGES:
        b, s, p = _parse(page)
        blocks += b
        spans += s
        prose += [(page, n, t) for n, t in p]
    return blocks, spans, prose


def _blocks(*langs: str) -> list[Snippet]:
    return [b for b in _all()[0] if b.lang in langs]


def _spans() -> list[Snippet]:
    return _all()[1]


# --------------------------------------------------------------------------- what the code knows

@functools.lru_cache(maxsize=None)
def _cli_parser() -> argparse.ArgumentParser:
    from striped_sp.cli import build_parser

    return build_parser()


def _subparsers(parser: argparse.ArgumentParser) -> dict:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


@functools.lru_cache(maxsize=None)
def _all_cli_flags() -> frozenset[str]:
    flags, todo = set(), [_cli_parser()]
    while todo:
        p = todo.pop()
        flags |= _options(p)
        todo += list(_subparsers(p).values())
    return frozenset(flags)


@functools.lru_cache(maxsize=None)
def plugin_flags() -> frozenset[str]:
    """The flags of the Megatron plugin: its own add-args function on a fresh parser."""
    from striped_sp.megatron import add_arguments

    return frozenset(_options(add_arguments(argparse.ArgumentParser())) - _options(argparse.ArgumentParser()))


def _megatron_lm_dirs() -> list[Path]:
    env = os.environ.get("MEGATRON_LM_DIR")
    dirs = [Path(env)] if env else []
    shared = ROOT.parent / "shared" / "megatron-lm"
    if shared.is_dir():
        dirs += sorted(p for p in shared.iterdir() if (p / "megatron" / "training" / "arguments.py").is_file())
    return dirs


@functools.lru_cache(maxsize=None)
def megatron_flags() -> frozenset[str] | None:
    """Megatron-LM's own flags: its parser built from the checkout that matches the installed
    megatron-core (``add_megatron_arguments`` in a subprocess), and the flags named in the other
    checkouts' ``arguments.py``; ``None`` when no checkout is at hand."""
    dirs = _megatron_lm_dirs()
    if not dirs:
        return None
    flags: set[str] = set()
    try:
        from importlib.metadata import version

        tag = f"core_v{version('megatron-core')}"
    except Exception:  # noqa: BLE001 - megatron-core is optional
        tag = None
    for d in dirs:
        src = (d / "megatron" / "training" / "arguments.py").read_text()
        flags |= set(re.findall(r"""['"](--[a-z0-9][a-z0-9_-]*)['"]""", src))
        if d.name == tag:
            code = ("import argparse, json, sys, warnings; warnings.filterwarnings('ignore'); "
                    f"sys.path.insert(0, {str(ROOT / 'tests' / 'support')!r}); import megatron_cpu_shims; "
                    "megatron_cpu_shims.apply(); "  # megatron.training imports triton kernels
                    f"sys.path.insert(0, {str(d)!r}); "
                    "from megatron.training.arguments import add_megatron_arguments; "
                    "p = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False)); "
                    "print(json.dumps(sorted(o for a in p._actions for o in a.option_strings)))")
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
            if out.returncode == 0:
                flags |= set(json.loads(out.stdout.strip().splitlines()[-1]))
    return frozenset(flags)


@functools.lru_cache(maxsize=None)
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


@functools.lru_cache(maxsize=None)
def extras() -> frozenset[str]:
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return frozenset(cfg["options.extras_require"])


@functools.lru_cache(maxsize=None)
def _source_flags(path: Path) -> frozenset[str]:
    return frozenset(re.findall(r"""['"](--[a-z0-9][a-z0-9_-]*)['"]""", path.read_text()))


@functools.lru_cache(maxsize=None)
def _repo_script_flags() -> frozenset[str]:
    flags: set[str] = set()
    for path in [*ROOT.glob("examples/**/*.py"), *ROOT.glob("striped_sp/**/*.py")]:
        flags |= _source_flags(path)
    return frozenset(flags)


# ------------------------------------------------------------------------------ checking commands

class Problems(list):
    def add(self, snippet: Snippet, message: str) -> None:
        self.append(f"{snippet.where}: {message}")

    def check(self) -> None:
        assert not self, "the docs show things that do not exist:\n" + "\n".join(self)


def _flag_name(token: str) -> str:
    return token.split("=", 1)[0]


def check_megatron_flag(flag: str) -> str | None:
    """``None`` when ``flag`` exists for a Megatron launch, else the reason."""
    if flag in plugin_flags():
        return None
    if flag.startswith(PLUGIN_PREFIXES):
        return f"{flag} is not a flag of the plugin (striped_sp.megatron.add_arguments knows {sorted(plugin_flags())})"
    known = megatron_flags()
    if known is None or flag in known or flag in _all_cli_flags() or flag in _repo_script_flags() \
            or flag in OTHER_TOOLS_FLAGS:
        return None
    return f"{flag} is neither a plugin flag nor one of Megatron-LM's"


def check_cli(argv: list[str]) -> str | None:
    """``None`` when ``striped-sp ARGV`` exists (sub-commands, flags, and with no placeholders the
    whole command line), else the reason."""
    parser, rest = _cli_parser(), list(argv)
    while rest and rest[0] in _subparsers(parser):
        parser = _subparsers(parser)[rest.pop(0)]
    if _subparsers(parser) and rest not in (["--help"], ["-h"]):
        return f"striped-sp {' '.join(argv)}: expected one of {sorted(_subparsers(parser))} after {parser.prog!r}"
    for tok in rest:
        if tok.startswith("-") and not re.match(r"^-\d", tok) and _flag_name(tok) not in _options(parser):
            return f"{parser.prog} has no option {_flag_name(tok)}"
    if not any("$" in t or "PLACEHOLDER" in t for t in argv):
        import contextlib
        import io

        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                _cli_parser().parse_args(argv)
        except SystemExit as e:
            if e.code:
                return f"striped-sp {' '.join(argv)} does not parse: {err.getvalue().strip().splitlines()[-1]}"
    return None


_SEPARATORS = {";", "&&", "||", "|", "&", ";;", "(", ")"}


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell snippet (continuations joined, comments dropped, ``<...>``
    placeholders kept as one token)."""
    text = re.sub(r"<[A-Za-z][^<>\n]*>", "PLACEHOLDER", text.replace("\\\n", " "))
    commands = []
    for line in text.splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|()")
        lex.whitespace_split = True
        lex.commenters = "#"
        tokens = list(lex)
        cmd: list[str] = []
        for tok in tokens + [";"]:
            if tok in _SEPARATORS:
                if cmd:
                    commands.append(cmd)
                cmd = []
            else:
                cmd.append(tok)
    out = []
    for cmd in commands:
        while cmd and cmd[0] in ("do", "then", "else", "time", "exec"):
            cmd = cmd[1:]
        while cmd and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", cmd[0]):
            cmd = cmd[1:]
        if cmd and cmd[0] not in ("for", "done", "fi", "if", "while"):
            out.append(cmd)
    return out


_TORCHRUN_SWITCHES = {"--standalone", "--no-python", "--no_python"}


def _python_target(args: list[str]) -> tuple[str, str, list[str]] | None:
    """``("module", name, rest)`` / ``("script", path, rest)`` of a python or torchrun command line."""
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "-m":
            return "module", args[i + 1], args[i + 2:]
        if tok == "-c":
            return None
        if tok.startswith("-"):
            i += 1 if ("=" in tok or tok in _TORCHRUN_SWITCHES or tok.startswith("-O") or tok == "-u") else 2
            continue
        return "script", tok, args[i + 1:]
    return None


def _check_script_flags(path: Path, rest: list[str]) -> str | None:
    for tok in rest:
        if tok.startswith("--") and _flag_name(tok) not in _source_flags(path):
            if path.name == "pretrain_gpt.py":
                return check_megatron_flag(_flag_name(tok))
            return f"{path.relative_to(ROOT)} has no flag {_flag_name(tok)}"
    return None


def check_python(args: list[str]) -> str | None:
    target = _python_target(args)
    if target is None:
        return None
    kind, name, rest = target
    if kind == "module":
        if name == "striped_sp":
            return check_cli(rest)
        if name == "pytest":
            for tok in rest:
                if tok.startswith("tests/") and not (ROOT / tok.split("::")[0]).exists():
                    return f"{tok} does not exist"
            return None
        if not name.startswith("striped_sp"):
            return None
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            return f"python -m {name}: no such module"
        if name == "striped_sp.megatron.pretrain_gpt":
            for tok in rest:
                if tok.startswith("--") and _flag_name(tok) not in _source_flags(Path(spec.origin)):
                    why = check_megatron_flag(_flag_name(tok))
                    if why:
                        return why
            return None
        return _check_script_flags(Path(spec.origin), rest)
    path = ROOT / name
    if name.startswith(("examples/", "tests/", "striped_sp/", "docs/")) or path.exists():
        if not path.is_file():
            return f"{name} does not exist"
        return _check_script_flags(path, rest)
    return None  # a user's own script (train.py, pretrain_gpt.py in a Megatron-LM checkout)


def check_command(cmd: list[str]) -> str | None:
    prog = cmd[0].rsplit("/", 1)[-1]
    args = cmd[1:]
    if prog == "striped-sp":
        return check_cli(args)
    if prog in ("python", "python3", "python3.11", "python3.12"):
        return check_python(args)
    if prog == "torchrun":
        return check_python(args)
    if prog == "make":
        for tok in args:
            if not tok.startswith("-") and "=" not in tok and tok not in make_targets():
                return f"make {tok}: no such target in the Makefile"
        return None
    if prog in ("pip", "pip3") or (prog.startswith("python") and args[:2] == ["-m", "pip"]):
        for tok in args:
            m = re.match(r"^(?:\.|striped_sp)\[([\w,-]+)\]$", tok)
            if m:
                missing = [e for e in m.group(1).split(",") if e not in extras()]
                if missing:
                    return f"pip extra(s) {missing} not in setup.cfg (extras: {sorted(extras())})"
        return None
    if prog in ("bash", "sh") and args and args[0].endswith(".sh"):
        if args[0].startswith(("examples/", "tests/")) and not (ROOT / args[0]).is_file():
            return f"{args[0]} does not exist"
        return None
    if prog == "git" and args[:1] == ["apply"]:
        for tok in args:
            if "patches/megatron_lm_" in tok:
                name = tok.rsplit("/", 1)[-1]
                if not (ROOT / "striped_sp" / "patches" / name).is_file():
                    return f"no patch {name} in striped_sp/patches/"
        return None
    return None


# --------------------------------------------------------------------------- the tests: commands

def _shell_snippets() -> list[Snippet]:
    commands = re.compile(r"^(\S*/)?(striped-sp|make|python3?(\.\d+)?|torchrun|pip3?|git apply|bash)\b")
    inline = [s for s in _spans() if commands.match(s.text) and not s.text.startswith(("python_requires",))]
    return _blocks("bash", "sh", "shell", "console") + inline


def test_shell_commands_exist():
    problems = Problems()
    seen = 0
    for snip in _shell_snippets():
        try:
            cmds = shell_commands(snip.text)
        except ValueError as e:
            problems.add(snip, f"not a shell command line ({e}): {snip.text!r}")
            continue
        for cmd in cmds:
            if cmd[0].startswith("--"):  # a list of flags for a launch script
                for tok in cmd:
                    if tok.startswith("--"):
                        why = check_megatron_flag(_flag_name(tok))
                        if why:
                            problems.add(snip, why)
                continue
            seen += 1
            why = check_command(cmd)
            if why:
                problems.add(snip, why)
    assert seen > 20, f"only {seen} commands found: is the parser broken?"
    problems.check()


def test_documented_flags_exist():
    """Flags in inline code (``--context-parallel-algo striped``): the plugin's, Megatron-LM's or
    this repository's command lines'."""
    problems = Problems()
    for snip in _spans():
        if not snip.text.startswith("--"):
            continue
        for tok in snip.text.replace(",", " ").split():
            if tok.startswith("--") and re.match(r"^--[a-z0-9][a-z0-9_-]*(=.*)?$", tok):
                why = check_megatron_flag(_flag_name(tok))
                if why:
                    problems.add(snip, why)
    problems.check()


def test_plugin_flags_are_documented():
    """The other way round: every flag of the Megatron plugin appears in docs/megatron.md."""
    text = (ROOT / "docs" / "megatron.md").read_text()
    missing = [f for f in sorted(plugin_flags()) if f not in text]
    assert not missing, f"docs/megatron.md does not mention the plugin flags {missing}"


# ------------------------------------------------------------------------------- the tests: JSON

def _json_objects(text: str):
    for candidate in (text, "{" + text.strip().rstrip(",") + "}"):
        try:
            value = json.loads(candidate)
        except ValueError:
            continue
        return value
    return None


def test_deepspeed_json_is_accepted():
    pytest.importorskip("deepspeed")
    from striped_sp.deepspeed import parse_config

    problems = Problems()
    found = 0
    snippets = _blocks("json") + [s for s in _spans() if '"context_parallel"' in s.text]
    for snip in snippets:
        value = _json_objects(snip.text)
        if value is None:
            if snip.lang == "json":
                problems.add(snip, "not JSON (nor the inside of a JSON object)")
            continue
        if not isinstance(value, dict) or "context_parallel" not in value:
            continue
        found += 1
        try:
            parse_config(value)
        except ValueError as e:
            problems.add(snip, f"parse_config refuses it: {e}")
    assert found >= 5, f"only {found} context_parallel sections found"
    problems.check()


def test_deepspeed_keys_exist():
    from striped_sp.deepspeed import ContextParallelSettings

    # the window hint comes from the model, not the JSON (deepspeed/window_hint.py)
    keys = {f.name for f in dataclasses.fields(ContextParallelSettings)} - {"sequence_parallel_size", "window", "global_every"}
    problems = Problems()
    for snip in _spans():
        for key in re.findall(r"\bcontext_parallel\.(\w+)", snip.text):
            if key not in keys:
                problems.add(snip, f"context_parallel.{key} is not a key (keys: {sorted(keys)})")
    problems.check()


# ----------------------------------------------------------------------------- the tests: Python

def _resolve(dotted: str):
    """Import the longest module prefix of ``dotted`` and walk the rest as attributes;
    ``ImportError`` of an optional dependency propagates, ``AttributeError`` means missing."""
    parts = dotted.split(".")
    obj, i = None, len(parts)
    while i > 0:
        name = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        if spec is not None:
            obj = importlib.import_module(name)
            break
        i -= 1
    if obj is None:
        raise AttributeError(dotted)
    for attr in parts[i:]:
        obj = getattr(obj, attr)
    return obj


def _optional_missing(err: ImportError) -> bool:
    text = str(err)
    return any(dep in text for dep in ("transformers", "accelerate", "trl", "deepspeed", "megatron", "flash_attn"))


def _check_name(problems: Problems, snip: Snippet, name: str) -> None:
    """A problem unless the dotted ``striped_sp`` name exists (a missing optional dependency skips it)."""
    try:
        _resolve(name)
    except AttributeError:
        problems.add(snip, f"{name} does not exist")
    except ImportError as e:
        if not _optional_missing(e):
            problems.add(snip, f"{name}: {e}")


def _names_used(tree: ast.AST) -> list[str]:
    """Dotted ``striped_sp`` names a snippet imports or uses (aliases resolved)."""
    alias: dict[str, str] = {}
    used: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "striped_sp":
                    used.append(a.name)
                    alias[a.asname or a.name.split(".")[0]] = a.name if a.asname else "striped_sp"
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "striped_sp":
            for a in node.names:
                used.append(f"{node.module}.{a.name}")
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [], node
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in alias:
                used.append(".".join([alias[base.id], *reversed(chain)]))
    return used


def test_python_snippets_compile_and_name_what_exists():
    problems = Problems()
    found = 0
    for snip in _blocks("python", "py"):
        found += 1
        try:
            tree = ast.parse(snip.text)
        except SyntaxError as e:
            problems.add(snip, f"does not compile: {e}")
            continue
        for name in dict.fromkeys(_names_used(tree)):
            _check_name(problems, snip, name)
    assert found >= 8, f"only {found} Python blocks found"
    problems.check()


def test_inline_striped_sp_names_exist():
    problems = Problems()
    for snip in _spans():
        for name in re.findall(r"\bstriped_sp(?:\.[A-Za-z_]\w*)+", snip.text):
            _check_name(problems, snip, name)
    problems.check()


# ------------------------------------------------------------------------ the tests: links, paths

def _slug(heading: str) -> str:
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@functools.lru_cache(maxsize=None)
def _anchors(page: Path) -> frozenset[str]:
    out, in_block = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith("```"):
            in_block = not in_block
        elif not in_block and line.startswith("#"):
            out.add(_slug(line.lstrip("#")))
    return frozenset(out)


def test_links_point_to_files_that_exist():
    problems = Problems()
    for page, n, line in _all()[2]:
        snip = Snippet(page, n, "prose", line)
        for target in re.findall(r"\]\(([^)\s]+)\)", line):
            if re.match(r"^[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                problems.add(snip, f"link to {target}: {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                problems.add(snip, f"link to {target}: no heading #{anchor} in {dest.name}")
    problems.check()


def test_repository_paths_exist():
    """Paths in inline code (``tests/integration/megatron/test_megatron_mla.py``, ``examples/deepspeed/train.py``)."""
    problems = Problems()
    pattern = re.compile(r"^(?:\.\./)?((?:striped_sp|tests|examples|docs|patches)/[\w./-]*)$")
    for snip in _spans():
        for tok in snip.text.split():
            m = pattern.match(tok.strip("(),;:"))
            if m and not (ROOT / m.group(1).split("::")[0]).exists():
                problems.add(snip, f"{m.group(1)} does not exist")
    problems.check()


def test_environment_variables_exist():
    source = "\n".join(p.read_text() for p in ROOT.glob("striped_sp/**/*.py"))
    problems = Problems()
    for snip in _spans() + _blocks("bash", "sh", "python"):
        for var in re.findall(r"\bSTRIPED_SP_[A-Z0-9_]+", snip.text):
            if var not in source:
                problems.add(snip, f"{var} is read nowhere in striped_sp/")
    problems.check()


def test_readme_is_short_and_keeps_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 160, "README.md is meant to be read in five minutes"
    assert "make demo" in text and "make test" in text
    assert {"demo", "test"} <= make_targets()


def test_docs_speak_of_no_machine_load_dates_or_commits():
    """User docs: no load averages, no timestamps of experiments, no commit hashes (a date on a
    results table, ``Date: YYYY-MM-DD``, is the one date allowed)."""
    problems = Problems()
    for page, n, line in _all()[2]:
        snip = Snippet(page, n, "prose", line)
        if re.search(r"load average|\bat load\b|this machine|\bUTC\b", line, re.I):
            problems.add(snip, f"speaks of the machine's load or time: {line.strip()!r}")
        if re.search(r"\bcommit\b[^.]*\b[0-9a-f]{7,40}\b|`[0-9a-f]{7,40}`", line):
            problems.add(snip, f"names a commit: {line.strip()!r}")
        for m in re.finditer(r"\b20\d\d-\d\d-\d\d\b", line):
            if not re.search(r"(?i)\bdate\b", line):
                problems.add(snip, f"dates an experiment ({m.group(0)}); only results tables carry a date")
    problems.check()


# ------------------------------------------------------------------------- cheap examples that run

def _self_contained(tree: ast.AST) -> bool:
    """Every name the snippet reads it has defined or imported before (no ``model``, ``q``,
    ``group`` left to the reader), and it starts no process group."""
    import builtins

    first_store: dict[str, tuple[int, int]] = {}
    loads: list[tuple[str, tuple[int, int]]] = []

    def store(name, node):
        first_store.setdefault(name, (node.end_lineno, node.end_col_offset))

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "init_process_group":
            return False
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                store((a.asname or a.name).split(".")[0], node)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Lambda)):
            if not isinstance(node, ast.Lambda):
                store(node.name, node)
            for a in ast.walk(node.args) if not isinstance(node, ast.ClassDef) else ():
                if isinstance(a, ast.arg):
                    first_store.setdefault(a.arg, (0, 0))
        elif isinstance(node, ast.comprehension):  # its own scope, read in the element before
            for n in ast.walk(node.target):
                if isinstance(n, ast.Name):
                    first_store.setdefault(n.id, (0, 0))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):  # the value is read first
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        store(n.id, node)
        elif isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                loads.append((node.id, (node.lineno, node.col_offset)))
            else:
                first_store.setdefault(node.id, (node.lineno, node.col_offset))
    return all(name in dir(builtins) or (name in first_store and first_store[name] <= pos) for name, pos in loads)


def test_self_contained_python_snippets_run(tmp_path):
    """Python blocks that need nothing from the reader run as they are."""
    runnable = [b for b in _blocks("python", "py") if _self_contained(ast.parse(b.text))]
    assert runnable, "no self-contained Python block found"
    problems = Problems()
    for i, snip in enumerate(runnable):
        script = tmp_path / f"snippet{i}.py"
        script.write_text(snip.text)
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                             env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)})
        if out.returncode:
            problems.add(snip, "fails:\n" + (out.stdout + out.stderr)[-2000:])
    problems.check()


def _quick_start() -> Snippet:
    for snip in _blocks("python"):
        if snip.page.name == "README.md" and snip.text.startswith("# quickstart.py"):
            return snip
    raise AssertionError("README.md has no block starting with '# quickstart.py'")


def test_readme_quick_start_runs_on_two_ranks(tmp_path):
    snip = _quick_start()
    assert len(snip.text.splitlines()) <= 12, "the quick start is meant to be about ten lines"
    script = tmp_path / "quickstart.py"
    script.write_text(snip.text)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-port", str(29500 + os.getpid() % 1000), str(script)],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    errors = [float(x) for x in re.findall(r"max error ([0-9.e+-]+)", out.stdout)]
    assert len(errors) == 2 and max(errors) < 1e-4, out.stdout


def test_results_command_balance_section(tmp_path):
    """``make results``' cheapest section, into a scratch copy of docs/results.md."""
    pytest.importorskip("matplotlib")
    shutil.copy(ROOT / "docs" / "results.md", tmp_path / "results.md")
    out = subprocess.run([sys.executable, "-m", "striped_sp.bench.results", "--only", "balance", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert (tmp_path / "balance_steps.png").stat().st_size > 1000
    assert (tmp_path / "bench_balance.png").stat().st_size > 1000
    text = (tmp_path / "results.md").read_text()
    assert "1.8750" in text  # contiguous at N = 8: (2N - 1) / N
    begin = text.index("<!-- results:balance -->")
    assert text.index("<!-- /results:balance -->") > begin


_MLA_ROUTE = r'''
import os, sys, warnings
warnings.filterwarnings("ignore")
import torch, torch.distributed as dist
dist.init_process_group("gloo", rank=0, world_size=1, init_method="tcp://127.0.0.1:" + sys.argv[2])
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import MLATransformerConfig
import striped_sp.megatron as sm
if sys.argv[1] == "without-the-fix":
    import striped_sp.megatron.mla as mla
    mla.te_flag_fix = lambda load=True: None
sm.install("striped")
config = MLATransformerConfig(num_layers=1, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4,
    kv_lora_rank=8, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, attention_dropout=0.0,
    hidden_dropout=0.0, use_cpu_initialization=True, params_dtype=torch.float32, normalization="RMSNorm")
spec = get_gpt_layer_local_spec(multi_latent_attention=True, normalization="RMSNorm")   # docs/megatron.md
try:
    model = GPTModel(config, spec, vocab_size=48, max_sequence_length=64, position_embedding_type="none")
except TypeError as e:
    print("TypeError:", e)
    sys.exit(3)
tokens = torch.randint(0, 48, (1, 16))
model(tokens, torch.arange(16)[None], None, labels=tokens).sum().backward()
assert sum(isinstance(m, sm.ContextParallelAttention) for m in model.modules()) == 1
from megatron.core.transformer import multi_latent_attention
sm.uninstall()
print("uninstalled HAVE_TE", multi_latent_attention.HAVE_TE)
'''


def _te_installed() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(_te_installed(), reason="Transformer Engine is installed: nothing to work around")
def _run_mla_route(tmp_path, mode: str, offset: int) -> subprocess.CompletedProcess:
    """docs/megatron.md's MLA route (``_MLA_ROUTE``) in a fresh interpreter, ``mode``
    ``with-the-fix`` or ``without-the-fix``."""
    pytest.importorskip("megatron.core")
    script = tmp_path / "mla_route.py"
    script.write_text(_MLA_ROUTE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    port = 29000 + os.getpid() % 500 + offset
    return subprocess.run([sys.executable, str(script), mode, str(port)], capture_output=True, text=True, env=env,
                          timeout=300)


def test_megatron_mla_local_spec_without_transformer_engine(tmp_path):
    """docs/megatron.md's MLA route, ``get_gpt_layer_local_spec(multi_latent_attention=True)``,
    builds and trains after ``install()`` on a machine without Transformer Engine, and
    ``uninstall()`` puts megatron-core's flag back."""
    from importlib.metadata import version

    fixed = _run_mla_route(tmp_path, "with-the-fix", 0)
    assert fixed.returncode == 0, fixed.stdout[-3000:] + fixed.stderr[-3000:]
    if version("megatron-core").startswith("0.16."):
        assert "uninstalled HAVE_TE True" in fixed.stdout, fixed.stdout


@pytest.mark.release
def test_megatron_mla_local_spec_fails_without_the_fix(tmp_path):
    """The plant of the test above: on megatron-core 0.16.1 the same script without the fix of
    ``striped_sp/megatron/mla.py`` fails with megatron-core's TypeError."""
    from importlib.metadata import version

    if not version("megatron-core").startswith("0.16."):
        pytest.skip("the TypeError is megatron-core 0.16's")
    broken = _run_mla_route(tmp_path, "without-the-fix", 1)
    assert broken.returncode == 3 and "isinstance() arg 2 must be a type" in broken.stdout, \
        broken.stdout[-3000:] + broken.stderr[-3000:]
