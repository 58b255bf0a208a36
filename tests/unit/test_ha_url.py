from __future__ import annotations

import pytest

from controlplane.ha.etcd import DEFAULT_PREFIX, StoreUrlInvalid, parse_store_url


def test_members_and_prefix() -> None:
    u = parse_store_url("etcd://10.0.0.1:2379,10.0.0.2:2379/prod/cp")
    assert u.endpoints == (("10.0.0.1", 2379), ("10.0.0.2", 2379))
    assert u.prefix == "/prod/cp"
    assert u.key("state", "rollouts", "m") == b"/prod/cp/state/rollouts/m"
    assert u.where == "etcd://10.0.0.1:2379,10.0.0.2:2379/prod/cp"


def test_default_prefix_and_ipv6() -> None:
    u = parse_store_url("etcd://[::1]:2379")
    assert u.endpoints == (("::1", 2379),)
    assert u.prefix == DEFAULT_PREFIX == "/controlplane"
    assert parse_store_url("etcd://h:1/").prefix == DEFAULT_PREFIX


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://h:2379", "expected etcd://"),
        ("etcd://h", "'h' is not HOST:PORT"),
        ("etcd://h:0", "'h:0' is not HOST:PORT"),
        ("etcd://h:2379,:2380", "':2380' is not HOST:PORT"),
        ("etcd://h:port", "'h:port' is not HOST:PORT"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, why: str) -> None:
    with pytest.raises(StoreUrlInvalid, match=why):
        parse_store_url(url)
