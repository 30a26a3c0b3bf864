"""The decode worker: the worker service with `worker.role = "decode"`, as its own process."""
