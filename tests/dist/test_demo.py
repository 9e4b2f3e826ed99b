"""The demo (``make demo``) runs on 2 spawned ranks and reports exact results for every layout."""

import re

from striped_sp import demo


def test_demo_prints_errors_and_work(capsys):
    demo.main(["--world-size", "2", "--tokens-per-rank", "24", "--seed", "3"])
    text = capsys.readouterr().out
    rows = {m[0]: m[1:] for m in re.findall(r"^(\w+)\s+([\d.e+-]+)\s+(\d+)\s+(\d+)\s+([\d.]+)$", text, re.M)}
    assert set(rows) == {"striped", "zigzag", "contiguous"}
    for layout, (err, w0, w1, _) in rows.items():
        assert float(err) < 1e-5
        assert int(w0) + int(w1) == 48 * 49 // 2  # the causal work of 48 tokens, split over ranks
    assert rows["contiguous"][1] == str(24 * 25 // 2)
    packed = {m[0]: m[1:] for m in re.findall(
        r"^(\w+)\s+([\d.e+-]+)\s+(\d+)\s+(\d+)\s+(\d+)\s+([\d.]+)$", text, re.M)}
    assert set(packed) == {"striped", "zigzag", "contiguous"}
    for layout, (err, w0, w1, padding, critical) in packed.items():
        assert float(err) < 1e-5, layout
        assert float(critical) >= 1.0 - 1e-9
    assert packed["striped"][3] == "0" and packed["contiguous"][3] == "0"
    assert "packed row:" in text
