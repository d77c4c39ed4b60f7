"""C kernels for the CPU path, each the fast twin of torch ops in ``ops/`` (gdn.py: a GDN layer's core), built with
the machine's C compiler on first use (build.py); where they cannot be built the layers keep the torch ops."""
