"""Benchmarks: scripts and CLIs that measure speed side by side with peers (never timed tests)."""
