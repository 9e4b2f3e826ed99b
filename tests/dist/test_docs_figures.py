"""The balance figures the docs quote are what their commands print today.

docs/results.md's packed-balance section is parsed (its tables, its prose figures and its ``bash``
block of commands): each table row is matched to the command of its block that makes it (the row's
``--docs`` / ``--window``, the header's layouts) and that command is run (``striped-sp bench balance``
in this process, ``--json``) at the cheap ring sizes; every cell must equal the printed figure as
the table rounds it.  The README's results rows run their own commands.  The figures other pages
quote (packed.md, tuning.md) are checked against those tables, or run where no table holds them.

``STRIPED_SP_DOCS_FIGURES=all`` runs every command at every ring size (a few minutes on two cores);
the default runs the rows at N = 8, the fixed:32 row and ``striped:place=auto`` at N = 32, and checks
the README's N = 32 row against results.md's table (under 30 s on two cores).

The default ``striped`` places packed rows by the cost model of the machine's default kernel: the
figures are the CPU model's, so the commands run as on a machine without CUDA.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
FULL = os.environ.get("STRIPED_SP_DOCS_FIGURES") == "all"
CHEAP_N = {8}
WEB = "lognormal:median=1024,sigma=1.2"
#: the rows of results.md's packed-balance table and the flags of the command that makes each
ROWS = {"web mix (lognormal, median 1024, sigma 1.2)": {"--docs": WEB},
        "one document, window 4096": {"--window": "4096"},
        "web mix + window 4096": {"--docs": WEB, "--window": "4096"}}


@pytest.fixture(autouse=True)
def _cpu_model(monkeypatch):
    """The docs quote the CPU model's plans: place rows as a process without CUDA does."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


_RUNS: dict[tuple, dict] = {}


def balance(argv: list[str]) -> dict:
    """``striped-sp ARGV --json`` run once per argument list: ``{(layout, N): record}``."""
    from striped_sp.cli import main

    key = tuple(argv)
    if key not in _RUNS:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "r.json"
            with contextlib.redirect_stdout(io.StringIO()):
                assert main([*argv, "--no-progress", "--json", str(path)]) == 0, argv
            _RUNS[key] = {(r["layout"], r["world_size"]): r for r in json.loads(path.read_text())}
    return _RUNS[key]


def _flag(argv: list[str], name: str):
    return argv[argv.index(name) + 1] if name in argv else None


def _with(argv: list[str], name: str, value: str) -> list[str]:
    out = list(argv)
    out[out.index(name) + 1] = value
    return out


def _text(page: str) -> str:
    return (ROOT / page).read_text()


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def _region(name: str) -> str:
    text = _text("docs/results.md")
    return text[text.index(f"<!-- results:{name} -->"):text.index(f"<!-- /results:{name} -->")]


def _tables(text: str) -> list[list[list[str]]]:
    """Markdown tables of ``text``: rows of stripped cells, the header first, the rule left out."""
    tables, cur = [], []
    for line in text.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not all(re.fullmatch(r":?-+:?", c) for c in cells):
                cur.append(cells)
        elif cur:
            tables.append(cur)
            cur = []
    return tables


def _commands(text: str) -> list[list[str]]:
    """The ``striped-sp bench balance`` commands of the bash blocks, without ``--plot``."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if line.startswith("striped-sp bench balance"):
                argv = shlex.split(line)[1:]
                if "--plot" in argv:
                    i = argv.index("--plot")
                    del argv[i:i + 2]
                out.append(argv)
    return out


def _layout(header: str) -> str:
    return re.match(r"`([^`]+)`", header).group(1)


def _packed_table():
    """results.md's main packed-balance table: ``{(row, N, layout): cell}`` and padding per (row, N)."""
    table = next(t for t in _tables(_region("packed-balance")) if t[0][0] == "row")
    head = table[0]
    lays = [_layout(h) for h in head[2:-1]]
    cells, padding = {}, {}
    for row in table[1:]:
        name, n = row[0], int(row[1])
        for lay, cell in zip(lays, row[2:-1]):
            cells[name, n, lay] = cell
        padding[name, n] = int(row[-1])
    return lays, cells, padding


def _command_for(row: str, lays: list[str], n: int) -> list[str]:
    """The block's command that makes ``row`` with ``lays`` at N = ``n``, run at that N alone."""
    want = ROWS[row]
    for argv in _commands(_region("packed-balance")):
        flags = {k: _flag(argv, k) for k in ("--docs", "--window")}
        if ({k: v for k, v in flags.items() if v} == want and _flag(argv, "--layouts") == ";".join(lays)
                and str(n) in _flag(argv, "--world-sizes").split(",")):
            return _with(argv, "--world-sizes", str(n))
    raise AssertionError(f"results.md: no command in the packed-balance block makes the row {row!r} at N = {n}")


def _run_n(n: int) -> bool:
    return FULL or n in CHEAP_N


def test_packed_balance_table_is_what_its_commands_print():
    lays, cells, padding = _packed_table()
    assert lays[:2] == ["striped", "striped:stripe=1"], "the default and stripes of 1 side by side"
    checked = 0
    for (row, n), pad in padding.items():
        argv = _command_for(row, lays, n)
        if not _run_n(n):
            continue
        recs = balance(argv)
        for lay in lays:
            assert cells[row, n, lay] == f"{recs[lay, n]['critical_path_over_ideal']:.4f}", (row, n, lay)
        assert pad == recs["zigzag", n]["padding_tokens"], (row, n)
        checked += 1
    assert checked >= 3


def _plan_table():
    table = next(t for t in _tables(_region("packed-balance")) if t[0][0] == "N")
    return {int(r[0]): r[1:] for r in table[1:]}


def test_the_defaults_plans_are_what_the_commands_print():
    """The plan the default chose per N, its balance, stripes of 1's, and both predicted times."""
    from striped_sp.bench.results import _plan_words

    _, cells, _ = _packed_table()
    web = next(r for r in ROWS if ROWS[r] == {"--docs": WEB})
    commands = _commands(_region("packed-balance"))
    for n, (plan, default, one, predicted) in _plan_table().items():
        if (web, n, "striped") in cells:  # the same figure as the main table's
            assert (default, one) == (cells[web, n, "striped"], cells[web, n, "striped:stripe=1"])
        if not _run_n(n):
            continue
        argv = next(a for a in commands if _flag(a, "--docs") == WEB and not _flag(a, "--window")
                    and str(n) in _flag(a, "--world-sizes").split(",")
                    and {"striped", "striped:stripe=1"} <= set(_flag(a, "--layouts").split(";")))
        recs = balance(_with(_with(argv, "--world-sizes", str(n)), "--layouts", "striped;striped:stripe=1"))
        d, s1 = recs["striped", n], recs["striped:stripe=1", n]
        assert d["plan_cost_model"] == "cpu"
        assert plan == _plan_words(d)
        assert default == f"{d['critical_path_over_ideal']:.4f}" == f"{d['plan_balance']:.4f}"
        assert one == f"{s1['critical_path_over_ideal']:.4f}"
        assert predicted == f"{d['predicted_ms']:.0f} / {s1['predicted_ms']:.0f}"


def test_packed_balance_prose_is_what_the_commands_print():
    text = _flat(_region("packed-balance"))
    commands = _commands(_region("packed-balance"))
    doc = next(a for a in commands if _flag(a, "--layouts") == "striped:stripe=doc")
    m = re.search(r"Per-document stripes \(`striped:stripe=doc`\) on the web mix at N = (\d+): (\d\.\d{4}), no padding", text)
    assert m, "results.md: the per-document stripes sentence"
    recs = balance(doc)
    assert m.group(2) == f"{recs['striped:stripe=doc', int(m.group(1))]['critical_path_over_ideal']:.4f}"
    short = next(a for a in commands if _flag(a, "--docs") == "fixed:32")
    m = re.search(r"\(`fixed:32`\): the default `striped` (\S+) \(([^)]*)\), `striped:stripe=1` (\S+) \(.*?\), "
                  r"`striped:place=auto` (\S+), zigzag (\S+) \(pads ([\d,]+) tokens\), contiguous (\d\.\d{4})", text)
    assert m, "results.md: the fixed:32 sentence"
    from striped_sp.bench.results import _plan_words

    recs = {lay: r for (lay, _), r in balance(short).items()}
    figures = [recs[lay]["critical_path_over_ideal"] for lay in
               ("striped", "striped:stripe=1", "striped:place=auto", "zigzag", "contiguous")]
    assert [m.group(i) for i in (1, 3, 4, 5, 7)] == [f"{x:.4f}" for x in figures]
    assert m.group(2) == _plan_words(recs["striped"])
    assert int(m.group(6).replace(",", "")) == recs["zigzag"]["padding_tokens"]


def _readme_rows() -> dict[str, list[str]]:
    table = next(t for t in _tables(_text("README.md")) if t[0][0].startswith("N = 8"))
    return {r[0]: r for r in table[1:]}


def _argv(cell: str) -> list[str]:
    return shlex.split(re.fullmatch(r"`(striped-sp .*)`", cell).group(1))[1:]


def test_readme_balance_rows_are_what_their_commands_print():
    rows = _readme_rows()
    dense = next(r for label, r in rows.items() if label.startswith("balance: critical path / ideal work"))
    recs = balance(_argv(dense[4]) + ["--world-sizes", "8"])
    assert dense[1:4] == [f"{recs[lay, 8]['critical_path_over_ideal']:.4f}" for lay in ("striped", "zigzag", "contiguous")]

    label, striped, zigzag, contiguous, cell = next(r for label, r in rows.items() if "packed web mix" in label)
    argv = _argv(cell)
    n = int(_flag(argv, "--world-sizes"))
    named = re.findall(r"`(striped:[^`]+)` / the default's", label) + ["striped"]
    assert named == ["striped:stripe=1", "striped"], label
    figures = striped.split(" / ")
    assert int(re.search(r"zigzag pads ([\d,]+) tokens", label).group(1).replace(",", "")) > 0
    _, cells, padding = _packed_table()
    web = next(r for r in ROWS if ROWS[r] == {"--docs": WEB})
    assert [*figures, zigzag, contiguous] == [cells[web, n, lay] for lay in (*named, "zigzag", "contiguous")]
    assert f"zigzag pads {padding[web, n]:,} tokens" in label
    if FULL:  # the row's own command (results.md's table runs at N = 32 too)
        recs = balance(argv)
        assert [*figures, zigzag, contiguous] == [f"{recs[lay, n]['critical_path_over_ideal']:.4f}"
                                                  for lay in (*named, "zigzag", "contiguous")]
        assert f"zigzag pads {recs['zigzag', n]['padding_tokens']:,} tokens" in label


def _results_figures():
    """``{(row, N, layout): float}`` of results.md's two packed-balance tables (N = 16 and 64 from the
    plan table: the default and stripes of 1 on the web mix)."""
    _, cells, _ = _packed_table()
    figures = {k: float(v) for k, v in cells.items()}
    web = next(r for r in ROWS if ROWS[r] == {"--docs": WEB})
    plans = _plan_table()
    for n, (_, default, one, predicted) in plans.items():
        figures[web, n, "striped"], figures[web, n, "striped:stripe=1"] = float(default), float(one)
        figures[web, n, "predicted"] = tuple(float(x) for x in predicted.split(" / "))
    return figures, web


def test_figures_quoted_in_packed_and_tuning_are_the_tables():
    figures, web = _results_figures()
    window, both = "one document, window 4096", "web mix + window 4096"
    web_ns = sorted(n for (r, n, lay) in figures if r == web and lay == "striped")
    default_web = [f"{figures[web, n, 'striped']:.2f}x" for n in web_ns]
    packed, tuning = _flat(_text("docs/packed.md")), _flat(_text("docs/tuning.md"))
    quoted = " / ".join(default_web) + f" ideal at N = {' / '.join(map(str, web_ns))}"
    assert f"on the web mix {quoted}" in packed
    assert f": {quoted}" in tuning
    assert (f"{figures[both, 8, 'striped']:.2f}x / {figures[both, 32, 'striped']:.2f}x with a window of 4096 "
            "at N = 8 / 32") in packed
    assert f"({figures[window, 8, 'zigzag']:.2f}x ideal for one long document with a window of 4096 at N=8)" in packed
    # the default on one document runs zigzag's order where the cost model says so (issue 57): zigzag's balance
    assert figures[window, 8, "striped"] in (figures[window, 8, "striped:stripe=1"], figures[window, 8, "zigzag"])
    assert f"stay at {figures[window, 8, 'striped:stripe=1']:.4f}x" in packed
    assert (f"({figures[both, 8, 'striped']:.2f}x ideal on the web mix at N = 8, where `striped:stripe=1` gives "
            f"{figures[both, 8, 'striped:stripe=1']:.4f}x)") in packed
    stripes_of_1 = [v for (r, n, lay), v in figures.items() if lay == "striped:stripe=1"]
    assert max(stripes_of_1) < 1.002 and "within 0.2% of ideal on the web mix and windows measured" in packed
    contiguous = [figures[web, n, "contiguous"] for n in (8, 32)]
    assert f"{min(contiguous):.1f}-{max(contiguous):.1f}x ideal on a web mix" in packed
    zig = [figures[r, n, "zigzag"] for r in (window, both) for n in (8, 32)]
    assert f"{min(zig):.1f}-{max(zig):.1f}x ideal under a window" in packed
    one_max = max(figures[web, n, "striped:stripe=1"] for n in web_ns)
    assert f"where `striped:stripe=1` stays within {one_max:.4f}x" in tuning
    gains = [1 - d / s for d, s in (figures[web, n, "predicted"] for n in web_ns)]
    assert f"time {min(gains):.0%}-{max(gains):.0%} below stripes of 1's".replace("%-", "-") in tuning


def test_figures_quoted_in_packed_and_tuning_that_no_table_holds():
    """stripe=doc, fixed:32 and place=auto figures, run; the H100 tile model's plan, by the API."""
    packed, tuning = _flat(_text("docs/packed.md")), _flat(_text("docs/tuning.md"))
    doc = balance(["bench", "balance", "--world-sizes", "8", "--tokens-per-rank", "8192", "--docs", WEB,
                   "--layouts", "striped:stripe=doc"])["striped:stripe=doc", 8]
    assert f"balance {doc['critical_path_over_ideal']:.4f} on the web mix at N = 8" in tuning
    short = {lay: r["critical_path_over_ideal"] for (lay, _), r in balance(
        ["bench", "balance", "--world-sizes", "32", "--tokens-per-rank", "32", "--docs", "fixed:32", "--layouts",
         "striped;striped:stripe=1;striped:place=auto;zigzag;contiguous"]).items()}
    assert short["striped"] == short["striped:place=auto"]
    assert f"`striped:stripe=1` reaches {short['striped:stripe=1']:.2f}x ideal there" in packed
    assert f"brings it to {short['striped:place=auto']:.2f}x" in packed
    assert (f"go from {short['striped:stripe=1']:.2f}x ideal (`striped:stripe=1`) to "
            f"{short['striped:place=auto']:.2f}x") in tuning
    ns = [8, 32]
    auto = balance(["bench", "balance", "--world-sizes", ",".join(map(str, ns)), "--tokens-per-rank", "8192",
                    "--docs", WEB, "--layouts", "striped:place=auto"])
    assert (f"`striped:place=auto` on the web mix: {auto['striped:place=auto', 8]['critical_path_over_ideal']:.4f}x "
            f"ideal at N = 8, {auto['striped:place=auto', 32]['critical_path_over_ideal']:.4f}x at N = 32") in packed

    from striped_sp.bench.docs import packed_row, parse_docs
    from striped_sp.plan.cost import model_for
    from striped_sp.plan.search import describe

    bounds = packed_row(parse_docs(WEB), 8 * 8192, seed=0)
    d = describe(bounds, 8, "auto", "auto", model_for("auto", "cuda"))
    assert (f"keeps documents up to {d['whole_max']} tokens whole at N = 8 ({d['balance']:.2f}x)") in tuning
