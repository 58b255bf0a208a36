"""Real peers the tests run (promtool and prometheus, etcd, dnsmasq, kubectl): found, or the
test skips on a developer's machine and fails in CI, where `.ci/run` installs them and sets
CONTROLPLANE_REQUIRE_<NAME>=1."""

from __future__ import annotations

import os

import pytest


def required(found: str | None, *, missing: str, env: str) -> str:
    """`found`, the path of a peer's binary; without it, skip, or fail when `env` is set.
    `missing` says what is missing and how to install it."""
    if found is not None:
        return found
    if os.environ.get(env):
        pytest.fail(f"{missing} ({env}={os.environ[env]})")
    pytest.skip(missing)
