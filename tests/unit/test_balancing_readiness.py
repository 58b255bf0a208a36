"""Servers no probe has seen ready yet (balancing/readiness.py): each rule of the table as a
case, and properties over any fleet."""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from controlplane.balancing.readiness import HoldReason, held_out
from controlplane.signals.store import EndpointKey


@dataclass(frozen=True)
class Server:
    """One endpoint as the rule sees it."""

    key: EndpointKey
    seen: bool  # a probe has seen it ready once
    ready: bool  # ready now, by the store's word (never heard: ready)
    first: bool  # there since the first round


def key(i: int) -> EndpointKey:
    return ("m", f"127.0.0.1:{8000 + i}")


def proven(i: int) -> Server:
    """Seen ready, and ready now."""
    return Server(key(i), seen=True, ready=True, first=False)


def loading(i: int, *, first: bool = False) -> Server:
    """Never seen ready; its health probe says not ready."""
    return Server(key(i), seen=False, ready=False, first=first)


def unheard(i: int, *, first: bool = False) -> Server:
    """Never seen ready and no not-ready word either: not heard yet, or only its page answers."""
    return Server(key(i), seen=False, ready=True, first=first)


def decide(*clusters: Sequence[Server]) -> dict[EndpointKey, HoldReason]:
    servers = [s for c in clusters for s in c]
    return held_out(
        [[s.key for s in c] for c in clusters],
        seen_ready={s.key for s in servers if s.seen},
        ready={s.key for s in servers if s.ready},
        first_round={s.key for s in servers if s.first},
    )


# ---- each rule


def test_nothing_is_held_when_every_server_was_seen_ready() -> None:
    assert decide([proven(1), proven(2)], [proven(3)]) == {}


def test_no_fleet_or_an_empty_version_holds_nothing() -> None:
    assert held_out([], seen_ready=set(), ready=set(), first_round=set()) == {}
    assert decide([]) == {}
    assert decide([], [unheard(1)]) == {}


def test_a_loading_server_is_held_out_while_its_cluster_has_a_server_seen_ready() -> None:
    assert decide([proven(1), loading(2)]) == {key(2): "not_ready"}


def test_a_server_ready_now_but_never_seen_ready_is_held_out() -> None:
    """Heard is not enough: its page may answer while its health probe times out."""
    assert decide([proven(1), unheard(2)]) == {key(2): "unproven"}
    assert decide([proven(1), unheard(2), unheard(3), unheard(4)]) == dict.fromkeys(
        [key(2), key(3), key(4)], "unproven"
    )


def test_a_server_seen_ready_once_is_never_held_here_whatever_it_says_now() -> None:
    """Its own not-ready word holds it (the store's load); this rule adds nothing."""
    once = Server(key(2), seen=True, ready=False, first=True)
    assert decide([proven(1), once]) == {}


def test_a_cluster_with_none_seen_ready_keeps_the_benefit_of_the_doubt() -> None:
    """A version replaced in one edit; a control plane that cannot see."""
    assert decide([unheard(1), unheard(2), loading(3)]) == {}
    assert decide([unheard(1, first=True), loading(2, first=True)]) == {}


def test_a_server_seen_ready_but_not_ready_now_proves_nothing_for_its_cluster() -> None:
    gone = Server(key(1), seen=True, ready=False, first=False)
    assert decide([gone, unheard(2), loading(3)]) == {}


def test_the_rule_is_per_version_not_per_model() -> None:
    """A version whose servers none was seen ready is not held because another version of the
    model has one."""
    assert decide([proven(1), unheard(2)], [unheard(3), loading(4)]) == {key(2): "unproven"}


def test_first_round_servers_are_held_while_at_most_half_of_their_cluster() -> None:
    assert decide([proven(1), unheard(2, first=True)]) == {key(2): "first_round"}
    assert decide([proven(1), proven(2), unheard(3, first=True), unheard(4, first=True)]) == dict.fromkeys(
        [key(3), key(4)], "first_round"
    )


def test_first_round_servers_keep_the_benefit_of_the_doubt_when_more_than_half() -> None:
    """A control plane restarted into a fleet it half sees must not pile the traffic onto
    the half it does."""
    assert decide([proven(1), unheard(2, first=True), unheard(3, first=True)]) == {}
    assert decide([proven(1), proven(2), *(unheard(i, first=True) for i in (3, 4, 5))]) == {}


def test_the_half_counts_the_whole_cluster_and_only_first_round_servers_ready_now() -> None:
    # Two doubted of four is half: held. The loading one is held on its own word either way.
    assert decide([proven(1), unheard(2, first=True), unheard(3, first=True), loading(4, first=True)]) == {
        key(2): "first_round",
        key(3): "first_round",
        key(4): "not_ready",
    }
    # Three doubted of five is more: they are served; the loading one stays held.
    cluster = [proven(1), *(unheard(i, first=True) for i in (2, 3, 4)), loading(5, first=True)]
    assert decide(cluster) == {key(5): "not_ready"}


def test_a_first_round_server_heard_not_ready_is_not_among_the_doubted() -> None:
    """Then the one unheard is alone in the doubt, at most half, and held."""
    assert decide([proven(1), loading(2, first=True), unheard(3, first=True)]) == {
        key(2): "not_ready",
        key(3): "first_round",
    }


def test_servers_that_joined_later_get_no_benefit_of_the_doubt_however_many() -> None:
    later = [unheard(i) for i in range(2, 9)]
    assert decide([proven(1), *later]) == {s.key: "unproven" for s in later}
    mixed = [proven(1), unheard(2, first=True), unheard(3), unheard(4)]
    assert decide(mixed) == {key(2): "first_round", key(3): "unproven", key(4): "unproven"}


def test_a_server_in_several_versions_is_one_server_given_the_doubt_by_one_of_them() -> None:
    """A version with no server seen ready serves it; another version that lists it cannot
    hold it (its load is one, for every version that lists it), in either order."""
    x = unheard(2)
    assert decide([x], [proven(1), x]) == {}
    assert decide([proven(1), x], [x]) == {}
    # Held where both versions would hold it.
    assert decide([proven(1), x], [proven(3), x]) == {key(2): "unproven"}


def test_for_a_server_in_several_versions_one_given_the_doubt_earlier_counts_as_proven_later() -> None:
    """The fleet lists an address once across a model's versions; should it not, the rule
    takes versions in order (as the weight loop always did)."""
    x, z = unheard(2), loading(3)
    assert decide([x], [x, z]) == {key(3): "not_ready"}
    assert decide([x, z], [x]) == {}


def test_ready_is_read_only_in_clusters_with_a_server_not_seen_ready() -> None:
    """The weight loop reads each server's word now (a whole load) only there."""

    class Spy(Set[EndpointKey]):
        def __init__(self, keys: Set[EndpointKey]) -> None:
            self.keys, self.asked = set(keys), set[object]()

        def __contains__(self, k: object) -> bool:
            self.asked.add(k)
            return k in self.keys

        def __iter__(self) -> Iterator[EndpointKey]:
            return iter(self.keys)

        def __len__(self) -> int:
            return len(self.keys)

    ready = Spy({key(i) for i in range(1, 6)})
    held = held_out(
        [[key(1), key(2)], [key(3), key(4)], [key(5)]],
        seen_ready={key(1), key(2), key(3), key(5)},
        ready=ready,
        first_round=set(),
    )
    assert held == {key(4): "unproven"}
    assert ready.asked <= {key(3), key(4)}


# ---- properties over any fleet

flags = st.tuples(st.booleans(), st.booleans(), st.booleans())  # seen, ready, first


@st.composite
def fleets(draw: st.DrawFn) -> list[list[Server]]:
    """Versions whose servers are each in one version only (as the fleet file has them)."""
    shapes = draw(st.lists(st.lists(flags, max_size=8), max_size=6))
    n = iter(range(1, 1000))
    return [[Server(key(next(n)), *f) for f in c] for c in shapes]


@st.composite
def tangled(draw: st.DrawFn) -> list[list[Server]]:
    """Versions that may share servers, in any order, even list one twice."""
    pool = [Server(key(i), *draw(flags)) for i in range(draw(st.integers(1, 8)))]
    return draw(st.lists(st.lists(st.sampled_from(pool), max_size=8), max_size=6))


def expected(cluster: Sequence[Server]) -> set[EndpointKey]:
    """The table, for one version whose servers are in no other."""
    unproven = [s for s in cluster if not s.seen]
    if not any(s.seen and s.ready for s in cluster):
        return set()
    doubted = [s for s in unproven if s.ready and s.first]
    let_in = doubted if 2 * len(doubted) > len(cluster) else []
    return {s.key for s in unproven if s not in let_in}


def check_always(fleet: list[list[Server]], held: dict[EndpointKey, HoldReason]) -> None:
    """What holds however versions share servers."""
    servers = {s.key: s for c in fleet for s in c}
    # Only servers never seen ready are held, each with its own reason.
    assert held.keys() <= {k for k, s in servers.items() if not s.seen}
    for k, why in held.items():
        s = servers[k]
        assert why == ("not_ready" if not s.ready else "first_round" if s.first else "unproven")
    # Never takes away the last ready server of a version.
    for c in fleet:
        if any(s.ready for s in c):
            assert any(s.ready and s.key not in held for s in c)


@given(fleets())
def test_the_table_decides_each_version_on_its_own(fleet: list[list[Server]]) -> None:
    held = decide(*fleet)
    check_always(fleet, held)
    assert set(held) == set[EndpointKey]().union(*map(expected, fleet))
    for c in fleet:
        mine = [s for s in c if s.key in held]
        # A version with no server seen ready and ready now holds nothing; first-round
        # servers ready now are held only while at most half of it.
        if mine:
            assert any(s.seen and s.ready for s in c)
        assert 2 * sum(held[s.key] == "first_round" for s in mine) <= len(c)


@given(fleets(), st.randoms(use_true_random=False))
def test_the_order_of_versions_does_not_matter_when_they_share_no_server(
    fleet: list[list[Server]], rng: random.Random
) -> None:
    shuffled = list(fleet)
    rng.shuffle(shuffled)
    assert decide(*shuffled) == decide(*fleet)


@given(tangled())
def test_versions_sharing_servers_still_never_lose_their_last_ready_one(fleet: list[list[Server]]) -> None:
    check_always(fleet, decide(*fleet))
