"""Pure-torch reference implementations: the CPU path of every layer and the reference of every Triton kernel.

One function per algorithm. Those with a Triton kernel carry its name plus ``_ref`` and its signature
(``rms_norm_ref`` for ``kernels.rms_norm``): the layers call them where the kernels do not run, and the kernel
tests compare against them. This package imports neither triton nor ``truespec.layers`` / ``truespec.kernels``:
imports run models -> layers -> kernels -> ops (tests/test_import_graph.py).
"""
