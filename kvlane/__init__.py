"""kvlane command-line tools: `kvlane up`, and the launcher they share with tests and benchmarks."""
