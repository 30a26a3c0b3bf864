"""Benchmarks and studies of kvlane, grouped by what they are.

* `loadtest.bench`: `kvlane bench`, a workload against a live local fleet (workloads, driver, client, report).
* `loadtest.simulation`: `kvlane simulate`, the fleet in virtual time, and its calibration and fidelity checks.
* `loadtest.dataplane`: what the request path costs: overhead, floors, bus hops, kvlane versus vLLM alone.
* `loadtest.routing`: routing studies in virtual time: policies, eviction, autoscaling, degradation, P/D.
"""
