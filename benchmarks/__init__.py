"""Benchmarks of dedupcore against its peers (pytest-benchmark); not part of the test suite."""
