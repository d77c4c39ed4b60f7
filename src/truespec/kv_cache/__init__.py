"""The cache memory: its configuration, who holds which KV block and state slot, and its layout on the device.

``config.py`` (CacheConfig), ``block_pool.py`` (reference-counted ids), ``manager.py`` (per-request blocks and
state groups, the prefix a new request starts from, ``cache_info``), ``prefix_cache.py`` (chained block keys, cached
blocks, LRU of unused ones), ``state_checkpoints.py`` (recurrent-state checkpoints for prefix caching),
``layout.py`` (tensor shapes, bytes, allocation, KV slot index, state slot copies), ``sizing.py`` (how many blocks
and checkpoints fit). Everything but ``layout.py`` and ``sizing.py`` is plain Python (no torch).
"""
