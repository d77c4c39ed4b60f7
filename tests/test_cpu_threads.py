"""The CPU thread count (worker/cpu_threads.py): small models run on one thread unless the user chose, a choice
(argument or environment) wins, and a bad one is an error naming it."""

import pytest
import torch

from truespec.config import EngineConfig
from truespec.worker.cpu_threads import SMALL_HIDDEN_SIZE, configure_cpu_threads


@pytest.fixture(autouse=True)
def keep_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.delenv("TRUESPEC_CPU_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    yield
    torch.set_num_threads(before)


def test_small_model_runs_on_one_thread_large_keeps_torchs() -> None:
    torch.set_num_threads(2)
    assert configure_cpu_threads(None, SMALL_HIDDEN_SIZE) == 1
    torch.set_num_threads(2)
    assert configure_cpu_threads(None, SMALL_HIDDEN_SIZE + 1) == 2


def test_users_choice_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    assert configure_cpu_threads(2, 256) == 2
    monkeypatch.setenv("TRUESPEC_CPU_THREADS", "2")
    assert configure_cpu_threads(None, 256) == 2
    monkeypatch.delenv("TRUESPEC_CPU_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    torch.set_num_threads(2)
    assert configure_cpu_threads(None, 256) == 2  # OMP_NUM_THREADS: torch's setting stays


def test_bad_thread_counts_name_their_field(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cpu_threads"):
            EngineConfig("model", cpu_threads=bad)
    monkeypatch.setenv("TRUESPEC_CPU_THREADS", "two")
    with pytest.raises(ValueError, match="TRUESPEC_CPU_THREADS"):
        configure_cpu_threads(None, 256)
