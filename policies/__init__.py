"""Routing policies: one module each, registered by name in `POLICIES`."""

import policies.disco
import policies.eldr
import policies.goodput.policy
import policies.kv_aware
import policies.least_request
import policies.lowest_tpm
import policies.power_of_two
import policies.prefix_aware
import policies.qos_drl.policy
import policies.random_pick
import policies.round_robin
import policies.session
import policies.shortest_queue  # noqa: F401  (importing a policy module registers it)
from policies.base import POLICIES, Policy, build_policy, register

__all__ = ["POLICIES", "Policy", "build_policy", "register"]
