"""What prefix affinity's Lua filter costs per request, through a real Envoy.

One Envoy, the control plane, two echo backends (they answer at once: what is measured is
the proxy). Three models on them: `plain` (least request), `body` (prompt_cache_key
affinity: json_to_metadata and set_filter_state, no Lua) and `prefix` (the Lua filter takes
the key from the body). Sequential keep-alive requests, the three models interleaved so
that every one sees the same machine, with a chat body whose first message is
`--system-bytes` long. Printed: the median and p90 round trip per model, and the
difference against `plain` measured in the same run: the per-request cost of the key.

    .venv/bin/python bench/lb_quality/lua_cost.py [--requests 3000] [--system-bytes 8192]
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE))

from real import Stack, free_port, start_proxied  # noqa: E402

from controlplane.sim.backend import EchoBackend  # noqa: E402

MODELS = {"plain": "", "body": "affinity: {body: prompt_cache_key}, ", "prefix": "affinity: {prefix: true}, "}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=3000, help="per model")
    p.add_argument("--system-bytes", type=int, default=8192, help="size of the first (system) message")
    p.add_argument("--keep", action="store_true")
    args = p.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="lua-cost-"))
    stack = Stack(workdir)
    backends = [EchoBackend(f"b{i}", "any").start() for i in range(2)]
    try:
        listener = free_port()
        eps = ", ".join(f"'{b.address}'" for b in backends)
        lines = [
            f"listener: {{port: {listener}}}",
            "tiers: {small: {max_params_b: 15, timeout: 30s}}",
            "signals: {enabled: false}",
            "models:",
        ]
        for m, aff in MODELS.items():
            lines.append(f"  {m}: {{params_b: 8, stable: v1, {aff}versions: {{v1: {{endpoints: [{eps}]}}}}}}")
        config = workdir / "fleet.yaml"
        config.write_text("\n".join(lines) + "\n")
        start_proxied(stack, workdir, config, listener, "lua-cost")
        system = ("You are a careful assistant. " * (args.system_bytes // 29 + 1))[: args.system_bytes]
        conns = {m: http.client.HTTPConnection("127.0.0.1", listener, timeout=10) for m in MODELS}
        times: dict[str, list[float]] = {m: [] for m in MODELS}
        for i in range(args.requests + 200):
            for m in MODELS:
                body = {
                    "model": m,
                    "max_tokens": 1,
                    "prompt_cache_key": f"k{i % 50}",
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}],
                }
                data = json.dumps(body).encode()
                start = time.perf_counter()
                conns[m].request(
                    "POST", "/v1/chat/completions", body=data, headers={"content-type": "application/json"}
                )
                r = conns[m].getresponse()
                r.read()
                took = time.perf_counter() - start
                if r.status != 200:
                    raise RuntimeError(f"{m}: HTTP {r.status}")
                if i >= 200:  # warm-up
                    times[m].append(took)
        base = statistics.median(times["plain"])
        print(
            f"{args.requests} requests per model, first message {args.system_bytes} bytes, one Envoy worker"
        )
        print("| model | median µs | p90 µs | median - plain µs |")
        print("|---|---|---|---|")
        for m, ts in times.items():
            ts.sort()
            med, p90 = statistics.median(ts), ts[int(0.9 * len(ts))]
            print(f"| {m} | {med * 1e6:.0f} | {p90 * 1e6:.0f} | {(med - base) * 1e6:+.0f} |")
        return 0
    finally:
        stack.stop()
        for b in backends:
            b.stop()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
