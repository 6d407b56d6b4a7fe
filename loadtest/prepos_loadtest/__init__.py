"""Session workloads and benchmarks for prepos."""
