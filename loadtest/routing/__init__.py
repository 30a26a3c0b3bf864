"""Routing studies in virtual time: which policy wins where, eviction, autoscaling, degradation, P/D disaggregation."""
