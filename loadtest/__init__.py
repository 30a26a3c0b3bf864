"""Load tests and benchmarks that drive a real local kvlane fleet."""
