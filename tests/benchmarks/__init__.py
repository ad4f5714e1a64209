"""Tests of the benchmark CLIs (functional only: nothing here is timed)."""
