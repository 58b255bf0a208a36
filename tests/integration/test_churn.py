"""The fleet moves, Envoy never blackholes: seeded random churn under steady load, on real Envoy.

Three permanent models carry about 30 requests per second through one Envoy (over an xDS
relay), while about 20 random edits land 0.3-1.5 s apart: a permanent model's version replaced
(the old one removed in the same edit), models added and removed, cluster-level edits (outlier
detection, circuit breakers, balancing, affinity, a valid cluster override), a NACKed override
beside another change and its later removal, the control plane killed (-9) and restarted, and
the xDS connection cut. Halfway, 1,000 concurrent scrapes of the control plane's /metrics (and
/debug/proxies) run beside the edits. Every request to a permanent model and every scrape must
succeed; at the end Envoy's clusters and endpoints must equal the fleet file and every type
must be SYNCED.

Run (one run per mode, in the default suite):

    .venv/bin/pytest tests/integration/test_churn.py -k "not repeated" -s

Reproduce a run: CHURN_SEED=1234 (printed in every report). Longer: CHURN_EDITS=40.
Some blackholes last a few milliseconds: CHURN_RATE=2000 (closed loop, in practice) sees them
far more often than the default 30 requests per second.
Once the churn stops, Envoy must match the fleet within CHURN_CONVERGE_LIMIT seconds (5).
Repeated runs (CHURN_RUNS in a row per mode, default 5, seeds CHURN_SEED, +1, ...):

    .venv/bin/pytest tests/integration/test_churn.py -m churn -s
    CHURN_RUNS=20 .venv/bin/pytest tests/integration/test_churn.py -k repeated -s
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from tests.integration.churn import ChurnResult, run_churn

pytestmark = pytest.mark.envoy


def seed_from_env() -> int:
    return int(os.environ.get("CHURN_SEED") or random.SystemRandom().randrange(1, 1_000_000))


def edits_from_env() -> int:
    return int(os.environ.get("CHURN_EDITS") or 20)


def rate_from_env() -> float:
    return float(os.environ.get("CHURN_RATE") or 30.0)


def converge_limit() -> float:
    """Seconds the proxy may take to match the fleet once the churn stops (CHURN_CONVERGE_LIMIT)."""
    return float(os.environ.get("CHURN_CONVERGE_LIMIT") or 5.0)


def verdict(result: ChurnResult) -> list[str]:
    """What is wrong with one run (empty: it passed)."""
    problems = []
    if result.failures:
        first = result.failures[0]
        problems.append(
            f"{len(result.failures)} of {len(result.outcomes)} requests failed (first: {first.detail[:120]})"
        )
    if result.scrape_failures:
        problems.append(
            f"{len(result.scrape_failures)} status-port scrapes failed: {result.scrape_failures[0]}"
        )
    if result.converged_after is None:
        problems.append(result.convergence_error.splitlines()[0])
    elif result.converged_after > converge_limit():
        problems.append(f"converged only after {result.converged_after:.2f}s (limit {converge_limit()}s)")
    return problems


@pytest.mark.timeout(240)
# One run per transport in the default suite (43 s each, in parallel workers); -m churn
# repeats it with seeds.
@pytest.mark.parametrize("mode", ["sotw", "delta"])
def test_churn(mode: str, tmp_path: Path) -> None:
    seed = seed_from_env()
    print(f"\nchurn seed {seed} ({mode})")
    result = run_churn(
        tmp_path, delta=mode == "delta", seed=seed, edits=edits_from_env(), rate=rate_from_env()
    )
    print(result.report)
    print(f"took {result.duration:.1f}s")
    assert result.outcomes, "no traffic was sent"
    failed = len(result.failures)
    assert failed == 0, result.report
    assert result.scrape_failures == [], result.report
    assert result.converged_after is not None, result.report
    assert result.converged_after <= converge_limit(), (
        f"converged only after {result.converged_after:.2f}s\n{result.report}"
    )


def repeated_runs_wanted(config: pytest.Config) -> bool:
    return bool(os.environ.get("CHURN_RUNS")) or "churn" in (config.option.markexpr or "")


@pytest.mark.churn
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("mode", ["sotw", "delta"])
def test_churn_repeated(mode: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    if not repeated_runs_wanted(request.config):
        pytest.skip("repeated churn runs: select with -m churn or set CHURN_RUNS")
    runs = int(os.environ.get("CHURN_RUNS") or 5)
    first_seed = seed_from_env()
    results: list[ChurnResult] = []
    for i in range(runs):
        seed = first_seed + i
        result = run_churn(
            tmp_path / f"run{i}",
            delta=mode == "delta",
            seed=seed,
            edits=edits_from_env(),
            rate=rate_from_env(),
        )
        print(f"\n--- run {i + 1}/{runs}\n{result.report}\ntook {result.duration:.1f}s")
        results.append(result)
    summary = [
        f"run {i + 1} seed {r.seed}: {len(r.outcomes)} requests, {len(r.failures)} failed, "
        + (f"converged in {r.converged_after:.2f}s" if r.converged_after is not None else "NOT converged")
        for i, r in enumerate(results)
    ]
    print("\n" + "\n".join(summary))
    bad = {r.seed: verdict(r) for r in results if verdict(r)}
    assert not bad, "\n".join(summary) + "\n" + "\n".join(f"seed {s}: {p}" for s, p in bad.items())
