"""The prefill worker: the worker service with `worker.role = "prefill"`, as its own process."""
