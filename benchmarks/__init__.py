"""Benchmarks of the engine (run as ``python -m benchmarks.<name>``); see README.md."""
