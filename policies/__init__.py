"""Routing policies: one module each, registered by name in `POLICIES`."""

from policies import (  # noqa: F401  (import registers each policy)
    least_request,
    lowest_tpm,
    power_of_two,
    prefix_aware,
    random_pick,
    round_robin,
    session,
    shortest_queue,
)
from policies.base import POLICIES, Policy, build_policy, register

__all__ = ["POLICIES", "Policy", "build_policy", "register"]
