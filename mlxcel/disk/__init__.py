"""The prompt cache's disk tier (``--prompt-cache-dir``): every file of it, each named for the thread that runs it.

- ``index.py``: pure decisions, any thread: piece names, fingerprints, the
  runs a lookup may use, the budget's choice, the file header and its checks.
- ``directory.py``: the directory as every thread sees it: its settings,
  the counters behind one lock, listing, locking and opening its files.
- ``tier.py``: ``DiskTier``, what the actors and the engine hold: lookups
  on the cache store's Trio thread; start-up, statistics and reset in the
  engine's worker threads.
- ``writer.py``: the writer thread (pieces in, files out, the budget kept).
- ``reader.py``: the reader threads (a disk hit's files mapped and verified).
- ``device.py``: the device thread only (MLX): KV rows to host buffers,
  verified pieces back to KV.

Only ``device.py`` imports MLX, none imports Trio, and nothing here imports
the actors, the engine or HTTP (``tests/test_layering.py``): the tier's reads
and writes ride the step plan (``mlxcel/core/plan.py``'s ``DiskRead`` and
``DiskWrite``), which the device actor hands to ``device.py``.
"""
