import pytest

from proxy.fleet.registry import Registry
from proxy.types import Backend, BackendStats

UP = BackendStats(healthy=True)


def make() -> Registry:
    return Registry([Backend("a", "http://a", "m1"), Backend("b", "http://b", "m1"),
                     Backend("c", "http://c", "m2")])


def test_candidates_follow_health_and_draining() -> None:
    reg = make()
    assert reg.view("m1", 0.0).candidates == ()  # unknown health = not routable
    reg.publish({"a": UP, "b": UP, "c": BackendStats(healthy=False)})
    assert [b.name for b in reg.view("m1", 0.0).candidates] == ["a", "b"]
    assert reg.healthy_models() == ["m1"]
    assert [b.name for b in reg.view("m1", 0.0, exclude=["a"]).candidates] == ["b"]
    reg.drain("b")
    assert [b.name for b in reg.view("m1", 0.0).candidates] == ["a"]
    assert reg.serves("m2") and not reg.serves("m3")


def test_guard_counts_and_never_leaks() -> None:
    reg = make()
    with reg.guard("a"), reg.guard("a"):
        assert reg.inflight["a"] == 2
    with pytest.raises(RuntimeError), reg.guard("a"):
        raise RuntimeError("boom")
    assert reg.inflight["a"] == 0


def test_snapshots_are_replaced_not_mutated() -> None:
    reg = make()
    reg.publish({"a": UP})
    old = reg.stats
    reg.publish({"a": BackendStats(healthy=True, running=3)})
    assert old["a"].running == 0 and reg.stats["a"].running == 3
    with pytest.raises(TypeError):
        reg.stats["a"] = UP  # type: ignore[index]


def test_add_remove() -> None:
    reg = make()
    reg.publish({"a": UP, "b": UP})
    reg.add(Backend("d", "http://d", "m1"))
    with pytest.raises(ValueError, match="already"):
        reg.add(Backend("d", "http://d", "m1"))
    reg.remove("a")
    assert [b.name for b in reg.view("m1", 0.0).candidates] == ["b"]


def test_update_merges_and_rederives_only_on_health_changes() -> None:
    reg = make()
    reg.update({"a": UP, "zz": UP})  # not configured: ignored
    assert "zz" not in reg.stats
    assert [b.name for b in reg.view("m1", 0.0).candidates] == ["a"]
    before = reg.view("m1", 0.0).candidates
    reg.update({"a": BackendStats(healthy=True, running=5)})
    assert reg.stats["a"].running == 5
    assert reg.view("m1", 0.0).candidates is before  # same health: nothing re-derived
    reg.update({"b": UP})
    assert [b.name for b in reg.view("m1", 0.0).candidates] == ["a", "b"]
    reg.update({"a": BackendStats(healthy=False)})
    assert [b.name for b in reg.view("m1", 0.0).candidates] == ["b"]
    reg.remove("b")
    reg.add(Backend("a2", "http://a", "m1"))
    reg.update({"a2": UP})  # the next scrape's publish drops what was removed
    assert "b" not in reg.stats and reg.stats["a2"] == UP
    assert [b.name for b in reg.view("m1", 0.0).candidates] == ["a2"]


def test_a_model_group_spans_its_members_healthy_backends() -> None:
    reg = Registry([Backend("a", "http://a", "m1"), Backend("b", "http://b", "m1"),
                    Backend("c", "http://c", "m2")], {"team": ["m2", "m1", "m3"]})
    reg.publish({"a": UP, "b": BackendStats(healthy=False), "c": UP})
    assert [b.name for b in reg.view("team", 0.0).candidates] == ["c", "a"]  # member order
    assert reg.serves("team") and reg.healthy_models() == ["m1", "m2", "team"]
    reg.drain("c")
    assert [b.name for b in reg.view("team", 0.0).candidates] == ["a"]
    assert not Registry([], {"empty": ["m9"]}).serves("empty")


def test_panic_mode_routes_among_unhealthy_backends_only_when_none_is_healthy() -> None:
    down = BackendStats(healthy=False)
    reg = Registry([Backend("a", "http://a", "m1"), Backend("b", "http://b", "m1"),
                    Backend("c", "http://c", "m1"), Backend("d", "http://d", "m2")],
                   {"team": ["m1", "m2"]}, panic=True)
    reg.publish({"a": down, "b": UP, "d": UP})
    assert [b.name for b in reg.view("m1", 0.0).candidates] == ["b"]
    reg.publish({"a": down, "b": down, "d": UP})  # c never scraped: stays out
    assert [b.name for b in reg.view("m1", 0.0).candidates] == ["a", "b"]
    assert reg.panicking == {"m1"} and reg.healthy_models() == ["m2", "team"]
    assert [b.name for b in reg.view("team", 0.0).candidates] == ["d"]  # m2 is healthy
    reg.drain("a")
    assert [b.name for b in reg.view("m1", 0.0).candidates] == ["b"]
    reg.publish({"b": down, "d": down})
    assert reg.panicking == {"m1", "m2", "team"} and reg.healthy_models() == []
    reg.publish({"b": UP, "d": down})
    assert reg.panicking == {"m2"} and [b.name for b in reg.view("m1", 0.0).candidates] == ["b"]
    strict = Registry([Backend("a", "http://a", "m1")])
    strict.publish({"a": down})
    assert strict.view("m1", 0.0).candidates == () and strict.panicking == frozenset()


def test_lora_adapters_a_backend_lists_are_routed_to_it_under_their_name() -> None:
    reg = Registry([Backend("a", "http://a", "base"), Backend("b", "http://b", "base"),
                    Backend("c", "http://c", "other")], {"team": ["other", "sql"]})
    reg.publish({"a": UP, "b": UP, "c": UP})
    assert not reg.serves("sql") and reg.view("sql", 0.0).candidates == ()
    assert reg.set_served("a", ["base", "sql", "chat"]) is True
    assert reg.set_served("a", ["chat", "sql"]) is False  # same names: nothing changes
    assert reg.set_served("gone", ["sql"]) is False
    assert reg.set_served("c", ["other", "sql"]) is True
    assert [b.name for b in reg.view("sql", 0.0).candidates] == ["a", "c"]
    assert [b.name for b in reg.view("base", 0.0).candidates] == ["a", "b"]
    assert [b.name for b in reg.view("team", 0.0).candidates] == ["c", "a"]  # c once
    assert reg.serves("sql") and reg.serves("chat") and not reg.serves("nope")
    assert reg.served_by("a") == {"base", "sql", "chat"} and reg.served_by("b") == {"base"}
    a, b, c = reg.all()
    assert reg.model_on(a, "sql") == "sql"  # the adapter, on the server that has it
    assert reg.model_on(a, "base") == "base"
    assert reg.model_on(c, "team") == "other" and reg.model_on(a, "team") == "sql"
    assert reg.model_on(b, "team") == "base"  # no member served: its own model
    assert reg.healthy_models() == ["base", "chat", "other", "sql", "team"]
    reg.publish({"a": BackendStats(healthy=False), "b": UP, "c": UP})
    assert [b.name for b in reg.view("sql", 0.0).candidates] == ["c"]
    reg.remove("c")
    reg.set_served("a", [])  # unloaded: a serves its configured model only
    assert not reg.serves("sql") and reg.served_by("a") == {"base"}
