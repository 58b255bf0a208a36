"""Prefix affinity through the real stack: plain least request, session hashing and prefix
affinity on a shared-prefix chat workload.

Per policy, a fresh stack (empty caches): `--servers` emulated servers of one GPU class
(`controlplane emulate`, with the emulator's prefix cache: cached prompt tokens skip
prefill), the control plane, one real Envoy, and the workload from its own process
(`prefix_load.py`: system prompts x conversations, multi-turn, a share with no common
prefix). The load is a share of the fleet's capacity without any cache hit.

Printed per policy: TTFT p50/p90, throughput, the prefix-cache hit ratio the servers
themselves count (`vllm:prefix_cache_hits_total / _queries_total`, the whole run), the
busiest server's requests over the mean, errors; and ratios against plain least request
measured in the same run, and the hit ratio against the oracle's (a per-request
cache-aware picker over simulated caches, `prefix_load.py --oracle-servers`).

    .venv/bin/python bench/lb_quality/prefix.py [--load 0.7] [--policies least_request,session,prefix]
    .venv/bin/python bench/lb_quality/prefix.py --policies prefix,picker   # the picker's prefix index

`picker`: prefix affinity as `prefix`, and `balancing: picker` with one `controlplane picker`:
the picker's own prefix index (bounded load) chooses, the Lua hash is its fallback.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE))

from real import Stack, free_port, free_ports, start_pickers, start_proxied, wait_http  # noqa: E402

MODEL = "bench-8b"


def affinity(policy: str, args: argparse.Namespace) -> str:
    factor = f", hash_balance_factor: {args.balance_factor}"
    if policy == "session":
        return f"affinity: {{header: x-session-id{factor}}}, "
    if policy in ("prefix", "picker"):
        return f"affinity: {{prefix: {{messages: {args.prefix_messages}}}{factor}}}, "
    return ""


def counters(address: str) -> tuple[float, float]:
    queries = hits = 0.0
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:prefix_cache_queries_total{"):
                queries += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_hits_total{"):
                hits += float(line.rsplit(" ", 1)[1])
    return queries, hits


def run_policy(policy: str, args: argparse.Namespace, rate: float) -> dict[str, object]:
    workdir = Path(tempfile.mkdtemp(prefix=f"prefix-{policy}-"))
    stack = Stack(workdir)
    try:
        base = free_ports(args.servers)
        stack.spawn(
            "emulate",
            [
                str(BIN / "controlplane"),
                "emulate",
                "--listen",
                f"127.0.0.1:{base}",
                "--model",
                MODEL,
                "--slots",
                str(args.slots),
                "--count",
                str(args.servers),
                "--decode-ms-per-token",
                str(args.decode_ms),
                "--prefill-ms-per-token",
                str(args.prefill_ms),
                "--kv-capacity-tokens",
                str(args.kv_tokens),
            ],
        )
        addresses = [f"127.0.0.1:{p}" for p in range(base, base + args.servers)]
        for a in addresses:
            wait_http(f"http://{a}/health", 20, "emulated servers", stack.procs)
        listener = free_port()
        eps = ", ".join(f"'{a}'" for a in addresses)
        config = workdir / "fleet.yaml"
        picker = free_port() if policy == "picker" else None
        balancing = "picker" if picker else "least_request"
        config.write_text(
            f"listener: {{port: {listener}}}\n"
            + (f"picker: {{endpoints: ['127.0.0.1:{picker}']}}\n" if picker else "")
            + f"tiers: {{small: {{max_params_b: 15, timeout: 300s, balancing: {balancing}}}}}\n"
            f"models: {{{MODEL}: {{params_b: 8, stable: v1, {affinity(policy, args)}"
            f"versions: {{v1: {{endpoints: [{eps}]}}}}}}}}\n"
        )
        xds, admin = free_port(), free_port()
        serve = ["--admin-listen", f"127.0.0.1:{admin}"] if picker else []
        start_proxied(stack, workdir, config, listener, f"bench-{policy}", serve, xds=xds)
        if picker:
            start_pickers(stack, workdir, [picker], xds, admin)
        out = subprocess.run(
            [
                sys.executable,
                str(HERE / "prefix_load.py"),
                "--target",
                f"127.0.0.1:{listener}",
                "--model",
                MODEL,
                "--rate",
                f"{rate:.3f}",
                "--duration",
                str(args.duration),
                "--warmup",
                str(args.warmup),
                "--system-words",
                str(args.system_words),
                "--oracle-servers",
                str(args.servers),
                "--oracle-kv-tokens",
                str(args.kv_tokens),
                "--systems",
                str(args.systems),
                "--unique-share",
                str(args.unique_share),
                "--seed",
                str(args.seed),
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
        q = h = 0.0
        for a in addresses:
            dq, dh = counters(a)
            q, h = q + dq, h + dh
        result["hit_ratio"] = h / q if q else float("nan")
        return result
    finally:
        stack.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default="least_request,session,prefix", help="first is the baseline")
    p.add_argument("--load", type=float, default=0.7, help="share of the fleet's capacity with no cache hit")
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--decode-ms", type=float, default=10.0, help="per output token")
    p.add_argument("--prefill-ms", type=float, default=1.0, help="per prompt token not cached")
    p.add_argument("--system-words", type=int, default=600, help="tokens per system prompt")
    p.add_argument("--kv-tokens", type=int, default=6000, help="each server's KV capacity (its prefix cache)")
    p.add_argument("--systems", type=int, default=16, help="shared system prompts")
    p.add_argument("--unique-share", type=float, default=0.1, help="share of requests with no common prefix")
    p.add_argument(
        "--prefix-messages", type=int, default=1, help="prefix affinity's key: the first N messages"
    )
    p.add_argument("--balance-factor", type=int, default=150, help="hash_balance_factor of both affinities")
    p.add_argument("--duration", type=float, default=40.0)
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    # Mean prompt without any hit: the system prompt plus on average 2.5 earlier turns of 2 x 30
    # words and the new 30 (prefix_load's defaults: 6 turns, 30 words a turn); 24 output tokens.
    prompt = args.system_words + 2.5 * 60 + 30
    service_s = (prompt * args.prefill_ms + 24 * args.decode_ms) / 1000.0
    capacity = args.servers * args.slots / service_s
    rate = args.load * capacity
    print(
        f"{args.servers} servers x {args.slots} slots; mean service without a hit {service_s:.2f}s; "
        f"capacity {capacity:.1f} req/s; offered {rate:.1f} req/s ({args.load:.0%})",
        flush=True,
    )
    results = {}
    for policy in args.policies.split(","):
        print(f"running {policy} ...", flush=True)
        results[policy] = run_policy(policy, args, rate)
    base = results[args.policies.split(",")[0]]
    print(
        "\n| policy | requests | errors | TTFT p50 s | TTFT p90 s | req/s | hit ratio | hit / oracle "
        "| busiest / mean | TTFT p90 vs base |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for policy, r in results.items():
        oracle = float(r["oracle_hit_ratio"])  # type: ignore[arg-type]
        print(
            f"| {policy} | {r['requests']} | {r['errors']} | {float(r['ttft_p50']):.2f} | "  # type: ignore[arg-type]
            f"{float(r['ttft_p90']):.2f} | {float(r['throughput']):.1f} | {float(r['hit_ratio']):.2f} | "  # type: ignore[arg-type]
            f"{float(r['hit_ratio']) / oracle:.2f} (oracle {oracle:.2f}) | {float(r['max_over_mean']):.2f} | "  # type: ignore[arg-type]
            f"{float(r['ttft_p90']) / float(base['ttft_p90']):.2f}x |"
        )  # type: ignore[arg-type]
    for policy, r in results.items():
        print(f"{policy}: by server {r['by_server']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
