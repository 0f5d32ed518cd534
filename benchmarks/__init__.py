"""Benchmarks: engine (specd bench) and, later, end-to-end."""
