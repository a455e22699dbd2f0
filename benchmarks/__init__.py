"""Benchmarks: runnable scripts, each writes JSON under ``benchmarks/results/`` and prints a table.

``python -m benchmarks.run_all`` (``make bench``) runs them all; each also runs
alone (``python -m benchmarks.comm_memory --help``).
"""
