"""DiSCo: device-server cooperative dispatch and migration (policies/disco/policy.py)."""

from policies.disco.policy import Disco

__all__ = ["Disco"]
