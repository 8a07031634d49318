"""Small reference models for examples, tests and benchmarks."""
