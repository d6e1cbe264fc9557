"""``bench/llamacpp_host.py``: its probes run end to end on the fake engine's llama.cpp model (the real engine's
figures are in bench/README.md; the numbers themselves are timings, not asserted here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import llamacpp_host  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def test_both_probes_run_on_the_fake_and_report_every_shape_and_every_k():
    result = llamacpp_host.run("fake", replicas=2, repeats=1, cores=2.0)
    shapes = result["response"]
    assert set(shapes) == {"tiny", "held 2,000", "cold 1,800"}
    assert shapes["held 2,000"]["cached_tokens"] > 1000 > shapes["cold 1,800"]["cached_tokens"]  # the slot held it
    assert all(isinstance(s["response_ms"], float) for s in shapes.values())
    assert list(result["sharing"]) == [1, 2] and result["sharing"][1] == 1.0
    text = llamacpp_host.render(result)
    assert "response time, held 2,000" in text and "2 prefilling at once" in text


def test_bad_arguments_are_one_line_errors(capsys):
    with pytest.raises(SystemExit):
        llamacpp_host.main(["--replicas", "0"])
    assert "must be positive" in capsys.readouterr().err
