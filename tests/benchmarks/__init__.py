"""Tests of the benchmark scripts whose figures the docs quote (small sizes only)."""
