"""The prompt cache's disk tier (``--prompt-cache-dir``): every file of it, each named for the thread that runs it.

- ``index.py``: pure decisions, any thread: piece names, fingerprints, the
  runs a lookup may use, the budget's choice, the file header and its checks.
- ``tier.py``: the directory (file I/O, no MLX, no Trio).
- ``device.py``: the device thread only (MLX): KV rows to host buffers,
  verified pieces back to KV.

Nothing here imports the actors, the engine or HTTP: the actors hand the
tier's work over in their messages (``mlxcel/actors/messages.py``).
"""
