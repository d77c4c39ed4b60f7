"""The cache memory: its configuration, who holds which KV block and state slot, and its layout on the device.

``config.py`` (CacheConfig), ``block_pool.py`` (reference-counted ids), ``manager.py`` (per-request blocks and
state groups, ``cache_info``), ``layout.py`` (tensor shapes, bytes, allocation, KV slot index), ``sizing.py``
(how many blocks fit). Everything but ``layout.py`` and ``sizing.py`` is plain Python (no torch).
"""
