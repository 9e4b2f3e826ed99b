"""Docs that cannot drift: every knob's accepted values, as the docs list them, against the code's
own validation (and the code's lists against the docs' lists), so a value added, removed or
refused in the code fails here until the docs say so too.

* docs/deepspeed.md, the key table: ``algo`` and ``backend`` list exactly what the config model
  accepts; each value listed for every key parses with :func:`striped_sp.deepspeed.parse_config`;
  its "Stripe size" section names every form ``stripe_size`` accepts and calls none "not offered";
* docs/megatron.md: the ``--context-parallel-algo`` table lists exactly the plugin's algos, the
  ``--attention-backend`` list exactly the names the plugin maps, and every value shown for
  ``--striped-stripe-size`` / ``--striped-doc-placement`` parses with the plugin's own parser;
  what it says ``--striped-stripe-size auto`` gives with ``--sft`` is what the code chooses;
* docs/tuning.md, the settings-by-route table: each value of each route's column is accepted by
  that route (the core's ``get_layout``, the plugin's flags, the DeepSpeed section);
* README's knobs: the kernel list is exactly the core's backends;
* ``--striped-calibrate``: its help and megatron.md say the rank it times on (global rank 0, as
  ``calibrate_cost_model(group=None)`` does).
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
CODE = re.compile(r"`([^`]+)`")


def _table_rows(page: Path, header_start: str) -> list[list[str]]:
    """The rows (cells, stripped) of the markdown table whose header row starts with ``header_start``."""
    lines = page.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.startswith(header_start):
            rows = []
            for row in lines[i + 2:]:
                if not row.startswith("|"):
                    break
                rows.append([c.strip() for c in row.strip().strip("|").split("|")])
            return rows
    raise AssertionError(f"{page.name}: no table with header {header_start!r}")


def _row(rows, key: str) -> list[str]:
    found = [r for r in rows if key in r[0]]
    assert found, f"no row for {key!r}"
    return found[0]


def _values(cell: str) -> list[str]:
    """The inline-code values of a cell, before any parenthesised remark."""
    return CODE.findall(cell.split("(")[0])


def _json_value(text: str):
    text = text.strip()
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    return int(text) if text.isdigit() else text


def _parse_ds(key: str, value):
    from striped_sp.deepspeed import parse_config

    return parse_config({"sequence_parallel_size": 2, "context_parallel": {key: value}}, world_size=2)


# ---------------------------------------------------------------------------------------- DeepSpeed

def test_deepspeed_key_table_lists_what_the_config_accepts():
    pytest.importorskip("deepspeed")
    from striped_sp.deepspeed.config import ALGOS
    from striped_sp.kernels import BACKENDS

    rows = _table_rows(DOCS / "deepspeed.md", "| key | values | default |")
    algos = _values(_row(rows, "`context_parallel.algo`")[1])
    backends = _values(_row(rows, "`context_parallel.backend`")[1])
    assert set(algos) == set(ALGOS), f"deepspeed.md algo values {algos}; the code accepts {list(ALGOS)}"
    assert set(backends) == set(BACKENDS), f"deepspeed.md backend values {backends}; the code accepts {BACKENDS}"
    for key, values in (("algo", algos), ("backend", backends)):
        for value in values:
            _parse_ds(key, value)


def test_deepspeed_stripe_size_section_names_every_accepted_form():
    pytest.importorskip("deepspeed")
    text = (DOCS / "deepspeed.md").read_text()
    section = text[text.index("## Stripe size and document placement"):]
    end = section.find("\n## ", 3)
    section = section if end < 0 else section[:end]
    assert "not offered" not in section
    for form in ("doc", "auto"):
        assert f'`"{form}"`' in section, f'deepspeed.md "Stripe size" does not name stripe_size "{form}"'
        _parse_ds("stripe_size", form)
    for form in ("split", "auto"):
        assert f'`"{form}"`' in section
        _parse_ds("doc_placement", form)
    _parse_ds("stripe_size", 4)
    _parse_ds("doc_placement", 64)


# ---------------------------------------------------------------------------------------- Megatron

def _plugin_parser() -> argparse.ArgumentParser:
    from striped_sp.megatron import add_arguments

    return add_arguments(argparse.ArgumentParser())


def test_megatron_algo_table_and_backend_list_match_the_plugin():
    from striped_sp.megatron.arguments import ALGOS, ATTENTION_BACKENDS

    rows = _table_rows(DOCS / "megatron.md", "| `--context-parallel-algo` |")
    documented = [_values(r[0])[0] for r in rows]
    assert set(documented) == set(ALGOS), f"megatron.md algos {documented}; the plugin has {list(ALGOS)}"
    parser = _plugin_parser()
    for algo in documented:
        assert parser.parse_args(["--context-parallel-algo", algo]).context_parallel_algo == algo
    text = (DOCS / "megatron.md").read_text()
    item = text[text.index("- `--attention-backend` picks"):]
    item = item[:item.index("\n- ")]
    named = {v for v in CODE.findall(item) if not v.startswith("-") and "=" not in v and "_" not in v}
    assert named == set(ATTENTION_BACKENDS), f"megatron.md --attention-backend {named}; the plugin maps {set(ATTENTION_BACKENDS)}"


def test_megatron_striped_flag_values_parse():
    text = (DOCS / "megatron.md").read_text()
    parser = _plugin_parser()
    shown = re.findall(r"`(--striped-(?:stripe-size|doc-placement) [^`\n]+)`", text)
    assert shown, "megatron.md shows no --striped-* values"
    for flag in shown:
        name, values = flag.split(" ", 1)
        for value in values.split("|"):
            value = {"S": "4", "L": "64"}.get(value, value)
            parser.parse_args([name, value])


def test_megatron_auto_with_sft_is_what_the_code_chooses():
    from striped_sp.plan.stripe_choice import choose_stripe_size

    text = " ".join((DOCS / "megatron.md").read_text().split())
    chosen = choose_stripe_size(8192, 4, packed=True)
    if chosen == "auto":
        assert "with `--sft` and no window, the per-batch search" in text
    else:
        assert f"`{chosen}` with `--sft`" in text


def test_striped_calibrate_says_where_it_times():
    action = next(a for a in _plugin_parser()._actions if "--striped-calibrate" in a.option_strings)
    assert "global rank 0" in action.help and "first rank" not in action.help
    assert "global rank 0" in (DOCS / "megatron.md").read_text()


# ---------------------------------------------------------------------------------------- tuning.md

def test_tuning_settings_table_values_are_accepted_by_each_route():
    pytest.importorskip("deepspeed")
    from striped_sp.plan.layouts import get_layout

    rows = _table_rows(DOCS / "tuning.md", "| setting | core")
    parser = _plugin_parser()
    checked = 0
    for setting, key in (("layout", None), ("stripe size", "stripe_size"), ("placement", "doc_placement"),
                         ("window hint", None)):
        core, megatron, deepspeed = _row(rows, setting)[1:4]
        for value in CODE.findall(core):
            if value.startswith("layout="):
                get_layout(_json_value(value.split("=", 1)[1]))
            elif value.startswith(("stripe_size=", "doc_placement=")):
                name, raw = value.split("=", 1)
                get_layout("striped", **{name: _json_value(raw)})
            elif value.startswith('"'):
                get_layout("striped", **{key or "stripe_size": _json_value(value)}) if key else get_layout(
                    _json_value(value))
            checked += 1
        flag = None
        for value in CODE.findall(megatron):
            words = shlex.split(value)
            if words[0].startswith("--"):
                flag = words[0]
                parser.parse_args(words)
            elif flag is not None:
                parser.parse_args([flag, *words])
            checked += 1
        if key is not None and ":" in deepspeed:  # `"stripe_size"`: `512`, ...
            for value in CODE.findall(deepspeed.split(":", 1)[1]):
                _parse_ds(key, _json_value(value))
                checked += 1
    assert checked >= 13


# ---------------------------------------------------------------------------------------- README

def test_readme_kernel_list_is_the_cores():
    from striped_sp.kernels import BACKENDS

    line = next(li for li in (ROOT / "README.md").read_text().splitlines() if li.startswith("- Kernel:"))
    listed = re.search(r"`backend=([^`]+)`", line).group(1).split("|")
    assert set(listed) == set(BACKENDS), f"README's kernels {listed}; the core has {BACKENDS}"
