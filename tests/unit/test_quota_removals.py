"""The fleet watcher's removals rule counts quotas too (issue 40): a half-written file that
drops the quotas block, a tenant's or a model's quota, or one of their limits is held until
the file holds still, in the control plane and in the rate-limit service alike (both use
fleet/watch.py). Pure `removals`, and the watcher with a fake clock on a real file."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane import limits
from controlplane.fleet import parse_fleet
from controlplane.fleet.errors import FleetConfigInvalid
from controlplane.fleet.model import Fleet
from controlplane.fleet.watch import FleetFileWatcher, quota_removals, removals

BASE = """\
listener: {port: 10000}
tiers: {small: {max_params_b: 20}}
models:
  chat: {params_b: 8, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9001']}}}
  big: {params_b: 8, stable: v1, versions: {v1: {endpoints: ['127.0.0.1:9002']}}}
"""
QUOTAS = """\
quotas:
  key: {header: x-api-key}
  service:
    endpoints:
      - 127.0.0.1:18081
      - 127.0.0.1:18082
  default:
    requests_per_minute: 600
    tokens_per_minute: 200000
  tenants:
    acme:
      requests_per_minute: 60
      tokens_per_minute: 2000
    globex: {requests_per_minute: 100}
  models:
    big:
      default: {requests_per_minute: 30}
      tenants:
        acme: {requests_per_minute: 3}
"""


def fleet(quotas: str = QUOTAS) -> Fleet:
    return parse_fleet(BASE + quotas)


@pytest.mark.parametrize(
    ("edit", "gone"),
    [
        (lambda q: "", ["quotas"]),
        (lambda q: q.replace("    globex: {requests_per_minute: 100}\n", ""), ["quotas.tenants.globex"]),
        (lambda q: q.replace("      tokens_per_minute: 2000\n", ""),
         ["quotas.tenants.acme.tokens_per_minute"]),
        (lambda q: q.replace("    tokens_per_minute: 200000\n", ""), ["quotas.default.tokens_per_minute"]),
        (lambda q: q[: q.index("  models:")], ["quotas.models.big"]),  # a truncation, still valid
        (lambda q: q.replace("      default: {requests_per_minute: 30}\n", ""),
         ["quotas.models.big.default.requests_per_minute"]),
        (lambda q: q.replace("        acme: {requests_per_minute: 3}\n", "        {}\n").replace(
            "      tenants:\n        {}\n", ""), ["quotas.models.big.tenants.acme"]),
        (lambda q: q.replace("      - 127.0.0.1:18082\n", ""), ["1 endpoint(s) of quotas.service"]),
    ],
)  # fmt: skip
def test_each_quota_taken_away_is_a_removal(edit: object, gone: list[str]) -> None:
    assert callable(edit)
    new = fleet(edit(QUOTAS))
    assert quota_removals(fleet().quotas, new.quotas) == gone
    assert removals(fleet(), new) == f"it removes {', '.join(gone)}"


def test_changes_and_additions_are_not_removals() -> None:
    changed = QUOTAS.replace("requests_per_minute: 60", "requests_per_minute: 6").replace(
        "globex: {requests_per_minute: 100}", "globex: {requests_per_minute: 100, tokens_per_minute: 5}"
    )
    assert removals(fleet(), fleet(changed)) == ""
    assert removals(parse_fleet(BASE), fleet()) == ""  # quotas added
    assert quota_removals(None, None) == []


class Rig:
    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "fleet.yaml"
        self.now = 0.0
        self.served: list[Fleet] = []
        self.refused: list[FleetConfigInvalid] = []
        self.watcher = FleetFileWatcher(
            self.path, self.served.append, self.refused.append, clock=lambda: self.now
        )

    def poll(self, after_s: float = 0.25) -> None:
        self.now += after_s
        self.watcher.check()


def test_a_half_written_file_keeps_a_tenants_limit_until_it_holds_still(tmp_path: Path) -> None:
    rig = Rig(tmp_path)
    rig.path.write_text(BASE + QUOTAS)
    rig.poll()
    text = BASE + QUOTAS.replace(
        "    acme:\n      requests_per_minute: 60\n      tokens_per_minute: 2000\n", ""
    )
    rig.path.write_text(text)  # the writer, mid-edit: acme's limits gone for now
    for _ in range(int((limits.FILE_SETTLE_S - 0.3) / 0.25)):
        rig.poll()
    assert len(rig.served) == 1 and "quotas.tenants.acme" in rig.watcher.held
    spec = rig.served[-1].quotas
    assert spec is not None and spec.limit("acme", "chat", "requests_per_minute") == 60
    rig.path.write_text(BASE + QUOTAS.replace("requests_per_minute: 60", "requests_per_minute: 50"))
    rig.poll()  # the writer done: a change, out at once
    assert len(rig.served) == 2 and not rig.refused
    spec = rig.served[-1].quotas
    assert spec is not None and spec.limit("acme", "chat", "requests_per_minute") == 50
    rig.path.write_text(text)  # removed for good: out once it has held still
    rig.poll()
    assert len(rig.served) == 2
    rig.poll(limits.FILE_SETTLE_S)
    assert len(rig.served) == 3
    spec = rig.served[-1].quotas
    assert spec is not None and spec.limit("acme", "chat", "requests_per_minute") == 600
