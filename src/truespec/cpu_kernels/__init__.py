"""C kernels for the CPU path, each the fast twin of torch ops in ``ops/`` (gdn.py, attention.py, norm.py, rotary.py,
linear.py; the C sources beside them), built with the machine's C compiler on first use (build.py); where they cannot
be built the layers keep the torch ops."""
