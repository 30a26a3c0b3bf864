"""What the request path costs: added latency and CPU per request, the floors under it, kvlane versus vLLM alone."""
