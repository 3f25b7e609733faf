"""Benchmarks: the multi-turn chat workload (``mlxcel bench``), server launcher, floor, summaries.

Nothing here imports MLX in the caller's process; the in-process floor runs
in a subprocess (``mlxcel.bench.floor``).
"""
