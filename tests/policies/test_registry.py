import pytest
from pydantic import ValidationError

from policies import POLICIES, build_policy
from policies.base import UnknownPolicyError

CLASSIC = {"round_robin", "random", "least_request", "power_of_two", "shortest_queue",
           "lowest_tpm", "prefix_aware", "session"}


def test_registry_has_every_classic_policy() -> None:
    assert set(POLICIES) >= CLASSIC
    assert all(POLICIES[name].name == name for name in POLICIES)


@pytest.mark.parametrize("name", sorted(CLASSIC))
def test_every_policy_builds_with_defaults_and_rejects_unknown_params(name: str) -> None:
    assert build_policy(name).name == name
    with pytest.raises(ValidationError, match="bogus"):
        build_policy(name, {"bogus": 1})


def test_unknown_policy_is_named_with_the_known_ones() -> None:
    with pytest.raises(UnknownPolicyError, match=r"'nope'.*least_request"):
        build_policy("nope")


@pytest.mark.parametrize(("name", "params", "key"), [
    ("prefix_aware", {"balance_rel_threshold": 0.5}, "balance_rel_threshold"),
    ("prefix_aware", {"max_entries": 0}, "max_entries"),
    ("lowest_tpm", {"window_s": -1}, "window_s"),
    ("session", {"virtual_nodes": 0}, "virtual_nodes"),
    ("random", {"seed": "abc"}, "seed"),
])
def test_invalid_param_values_name_the_key(name: str, params: dict[str, object],
                                           key: str) -> None:
    with pytest.raises(ValidationError, match=key):
        build_policy(name, params)
