"""How many threads torch uses for a model on the CPU (``EngineConfig.cpu_threads``).

A small model's ops are too small to split across threads: on the embedded model (hidden size 256) a decode step
is hundreds of ops of a few microseconds each, and an OpenMP team pays a barrier per op. With a second thread the
speed is about the same on an idle 2-core machine, and collapses when anything else runs on the other core: 30
greedy tokens took 0.5 s with 1 thread and 18 s with 2 beside another busy process (this repository's development
machine). So "auto" runs models up to ``SMALL_HIDDEN_SIZE`` on one thread and leaves larger ones on torch's
setting (one thread per core), unless the user chose: ``cpu_threads=N``, or ``OMP_NUM_THREADS`` /
``TRUESPEC_CPU_THREADS`` in the environment.
"""

import os

import torch

SMALL_HIDDEN_SIZE = 1024


def configure_cpu_threads(cpu_threads: int | None, hidden_size: int) -> int:
    """Set torch's intra-op thread count for a CPU engine; returns the count in use."""
    env = os.environ.get("TRUESPEC_CPU_THREADS")
    if cpu_threads is None and env is not None:
        if not env.isdigit() or int(env) < 1:
            raise ValueError(f"TRUESPEC_CPU_THREADS must be a positive integer, got {env!r}")
        cpu_threads = int(env)
    if cpu_threads is None and "OMP_NUM_THREADS" not in os.environ and hidden_size <= SMALL_HIDDEN_SIZE:
        cpu_threads = 1
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
    return torch.get_num_threads()
