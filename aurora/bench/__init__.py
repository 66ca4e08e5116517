"""Benchmarks (`aurora bench ...`): they measure and print; they assert nothing."""
