"""Routing policies, each behind `RoutingPolicy`, chosen by `balancer.policy`."""

from __future__ import annotations

from services.balancer.policies.base import RoutingPolicy
from services.balancer.policies.cache_aware import KvCost, PrefixAffinity, ScoreBased
from services.balancer.policies.jffc import Jffc, JffcPerRequest
from services.balancer.policies.lora_affinity import LoraAffinity
from services.balancer.policies.simple import LeastLoaded, PowerOfTwo, RandomChoice, RoundRobin
from shared.config import BalancerSettings

POLICY_NAMES = (
    "round_robin", "random", "least_loaded", "power_of_two", "prefix_affinity", "kv_cost", "score", "jffc",
    "jffc_per_request", "lora_affinity",
)


def make_policy(name: str, settings: BalancerSettings) -> RoutingPolicy:
    match name:
        case "round_robin":
            return RoundRobin()
        case "random":
            return RandomChoice(settings.seed)
        case "least_loaded":
            return LeastLoaded()
        case "power_of_two":
            return PowerOfTwo(settings.seed)
        case "prefix_affinity":
            return PrefixAffinity(settings.prefix_affinity)
        case "kv_cost":
            return KvCost(settings.kv_cost)
        case "score":
            return ScoreBased(settings.score)
        case "jffc":
            return Jffc()
        case "jffc_per_request":
            return JffcPerRequest(settings.jffc_per_request.imposed_delay_weight, settings.jffc_per_request.cache_hold_share)
        case "lora_affinity":
            return LoraAffinity()
    raise ValueError(f"unknown routing policy {name!r} (known: {', '.join(POLICY_NAMES)})")


__all__ = ["POLICY_NAMES", "RoutingPolicy", "make_policy"]
