"""The README's main job: ``truespec demo`` runs on the embedded model and speculation changes no token."""

import pytest

from truespec.entrypoints.demo import run_demo


def test_demo_runs_and_speculation_is_lossless(capsys: pytest.CaptureFixture[str]) -> None:
    assert run_demo(device="cpu", max_tokens=24) == 0
    out = capsys.readouterr().out
    assert out.count("identical tokens: True") == 2 and "mean acceptance length" in out
