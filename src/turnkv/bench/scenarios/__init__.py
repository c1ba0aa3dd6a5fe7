"""Benchmark suites on the simulator: each starts its own processes per configuration, runs the load,
stops them, and writes one report in which every ratio compares configurations of the same run."""
