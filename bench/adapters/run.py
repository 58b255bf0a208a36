"""LoRA adapters (issue 45, docs/adapters.md): the picker that keeps adapters warm against the
same picker blind to adapters, and against no picker (Envoy's weights), in one run.

The emulated fleet: `--servers` servers (`controlplane emulate`), each with `--slots` request
slots and `--max-loras` adapter slots, every one of `--adapters` adapters registered
(`--lora-modules`), loading one into a slot costing `--lora-load-s` (docs/emulator.md#lora-
adapters); behind `--proxies` real Envoys and, in the picked arms, one picker. Requests name an
adapter drawn with Zipf popularity (`--zipf`), Poisson arrivals at `--load` of the fleet's
request capacity (its slots over a request's mean service, adapters ignored). Arms, each on a
fresh stack:

- `aware`: the picker, placing each adapter's requests where it is loaded (picker/adapters.py);
- `blind`: the same picker with --no-adapter-affinity (the least loaded server, wherever the
  adapter is);
- `nohop`: no picker: Envoy alone, hashing each adapter's requests on its name (the default
  of a model with adapters: Maglev with bounded load, docs/adapters.md#without-the-picker);
- `weights`: no picker, `affinity: false`: Envoy's weighted least request, blind to adapters.

Per arm: adapter loads per 1,000 requests (the servers' own counts, /emulator/stats), the
evictions they made, and time to first token and latency percentiles; then each against
`blind` measured in the same run; and the floor of loads that holding the most wanted
adapters in every slot leaves (the others' requests load on arrival). Everything on loopback;
every process stopped, on failure too.

    .venv/bin/python bench/adapters/run.py                   # about 5 minutes on 2 cores
    .venv/bin/python bench/adapters/run.py --seconds 30 --arms aware,blind
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE.parent / "lb_quality"))
sys.path.insert(0, str(REPO))

from loadgen import mean_output_tokens  # noqa: E402
from real import BIN, Stack, proxy_stat, start_pickers, start_proxied, wait_http  # noqa: E402

from bench.ports import free_port, free_ports  # noqa: E402

MODEL = "bench-8b"
ARMS = ("aware", "blind", "nohop", "weights")
PICKED = ("aware", "blind")


def fleet_yaml(args: argparse.Namespace, listener: int, picker: int, servers: list[str], name: str) -> str:
    picked = name in PICKED
    lines = [
        f"listener: {{port: {listener}}}",
        "signals: {interval: 500ms, timeout: 400ms}",
        f"picker: {{endpoints: ['127.0.0.1:{picker}'], timeout: 50ms}}",
        "tiers:",
        "  small:",
        "    max_params_b: 15",
        "    timeout: 300s",
        *(["    balancing: picker"] if picked else []),
        "models:",
        f"  {MODEL}:",
        "    params_b: 8",
        "    stable: v1",
        *(["    affinity: false"] if name == "weights" else []),
        "    adapters:",
        *(f"      a{i}: {{source: /adapters/a{i}}}" for i in range(args.adapters)),
        "    versions:",
        "      v1:",
        "        endpoints:",
        *(f"          - {{address: '{s}'}}" for s in servers),
    ]
    return "\n".join(lines) + "\n"


def service_s(args: argparse.Namespace) -> float:
    """A request's mean service with a slot and its adapter ready."""
    tokens = mean_output_tokens(24.0, 0.9, 1, 400)
    return float(args.prompt_words * args.prefill_ms + tokens * args.decode_ms) / 1000


def lora_counts(servers: list[str]) -> tuple[float, float]:
    """Adapter loads and evictions the servers have made, summed (their own counts)."""
    loads = evictions = 0.0
    for s in servers:
        with urllib.request.urlopen(f"http://{s}/emulator/stats", timeout=5) as r:
            lora = json.loads(r.read())["lora"] or {}
        loads += lora.get("loads_total", 0)
        evictions += lora.get("evictions_total", 0)
    return loads, evictions


def arm(args: argparse.Namespace, name: str, rate: float) -> dict[str, object]:
    work = Path(tempfile.mkdtemp(prefix=f"bench-adapters-{name}-"))
    stack = Stack(work)
    try:
        base = free_ports(args.servers)
        servers = [f"127.0.0.1:{base + i}" for i in range(args.servers)]
        emulate = [str(BIN / "controlplane"), "emulate", "--listen", servers[0], "--model", MODEL]
        emulate += ["--count", str(args.servers), "--slots", str(args.slots)]
        emulate += ["--max-loras", str(args.max_loras)]
        emulate += ["--lora-load-s", str(args.lora_load_s), "--decode-ms-per-token", str(args.decode_ms)]
        emulate += ["--prefill-ms-per-token", str(args.prefill_ms)]
        emulate += ["--lora-modules", *(f"a{i}=/adapters/a{i}" for i in range(args.adapters))]
        stack.spawn("emulate", emulate)
        for s in servers:
            wait_http(f"http://{s}/health", 30, "emulated servers", stack.procs)
        listener, picker, xds, admin = free_port(), free_port(), free_port(), free_port()
        config = work / "fleet.yaml"
        config.write_text(fleet_yaml(args, listener, picker, servers, name))
        serve = ["--admin-listen", f"127.0.0.1:{admin}"]
        node = f"bench-adapters-{name}"
        start_proxied(stack, work, config, listener, node, serve, proxies=args.proxies, xds=xds)
        if name in PICKED:
            blind = ["--no-adapter-affinity"] if name == "blind" else []
            start_pickers(stack, work, [picker], xds, admin, blind)
        time.sleep(2.0)  # every server seen ready by the control plane
        loads0, evictions0 = lora_counts(servers)
        cmd = [sys.executable, str(HERE / "load.py"), "--target", f"127.0.0.1:{listener}"]
        cmd += ["--rate", f"{rate:.3f}", "--duration", str(args.seconds), "--warmup", str(args.warmup)]
        cmd += ["--adapters", str(args.adapters), "--zipf", str(args.zipf), "--seed", str(args.seed)]
        cmd += ["--prompt-words", str(args.prompt_words)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True)
        result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
        loads, evictions = lora_counts(servers)
        sent = float(result["sent"])  # type: ignore[arg-type]
        result["loads_per_1k"] = round(1000 * (loads - loads0) / sent, 1) if sent else None
        result["evictions_per_1k"] = round(1000 * (evictions - evictions0) / sent, 1) if sent else None
        result["fell_back"] = sum(
            proxy_stat(p, "ext_proc.picker.failure_mode_allowed") for p in stack.envoy_admins
        )
        return result
    finally:
        stack.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    p.add_argument("--servers", type=int, default=4)
    p.add_argument("--slots", type=int, default=4, help="request slots per server")
    p.add_argument("--max-loras", type=int, default=2, help="adapter slots per server")
    p.add_argument("--adapters", type=int, default=16)
    p.add_argument("--zipf", type=float, default=1.0)
    p.add_argument("--lora-load-s", type=float, default=0.5, help="an adapter's load into a slot")
    p.add_argument("--load", type=float, default=0.8, help="of the fleet's request capacity")
    p.add_argument("--seconds", type=float, default=60.0, help="measured, per arm")
    p.add_argument("--warmup", type=float, default=10.0)
    p.add_argument("--proxies", type=int, default=3)
    p.add_argument("--prompt-words", type=int, default=32)
    p.add_argument("--prefill-ms", type=float, default=1.0, help="per prompt token")
    p.add_argument("--decode-ms", type=float, default=20.0, help="per output token")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if unknown := [a for a in arms if a not in ARMS]:
        p.error(f"--arms: unknown {unknown}; expected some of {', '.join(ARMS)}")
    capacity = args.servers * args.slots / service_s(args)
    rate = args.load * capacity
    print(
        json.dumps(
            {
                "capacity_rps": round(capacity, 2),
                "rate_rps": round(rate, 2),
                "service_s": round(service_s(args), 3),
                "load_cost_s": args.lora_load_s,
            }
        ),
        flush=True,
    )
    results: dict[str, dict[str, object]] = {}
    for name in arms:
        results[name] = arm(args, name, rate)
        print(json.dumps({"arm": name, **results[name]}), flush=True)
    report(results)
    print(
        f"\nfloor: {floor_per_1k(args):.0f} loads / 1k (every request of an adapter beyond the fleet's slots)"
    )
    return 0


def floor_per_1k(args: argparse.Namespace) -> float:
    """Loads per 1,000 requests if every adapter slot of the fleet held one of the most wanted
    adapters for good: each request of the others loads on arrival (fewer when requests of
    one wait together and share a load; more when a hot adapter needs more than one server)."""
    weights = [1 / (i + 1) ** args.zipf for i in range(args.adapters)]
    held = args.servers * args.max_loras
    return 1000 * sum(weights[held:]) / sum(weights)


def report(results: dict[str, dict[str, object]]) -> None:
    base = results.get("blind")
    print("\narm       loads/1k  evictions/1k  ttft p90  latency p90  (x blind: loads, ttft, latency)")
    for name, r in results.items():
        ratios = ""
        if base is not None and name != "blind":
            x = [_ratio(r.get(k), base.get(k)) for k in ("loads_per_1k", "ttft_p90", "latency_p90")]
            ratios = f"({', '.join(x)})"
        print(
            f"{name:<9} {r.get('loads_per_1k')!s:>8}  {r.get('evictions_per_1k')!s:>12}  "
            f"{_s(r.get('ttft_p90')):>8}  {_s(r.get('latency_p90')):>11}  {ratios}"
        )


def _s(seconds: object) -> str:
    return f"{seconds:.2f} s" if isinstance(seconds, int | float) else "-"


def _ratio(a: object, b: object) -> str:
    ok = isinstance(a, int | float) and isinstance(b, int | float) and b
    return f"{a / b:.2f}x" if ok else "-"  # type: ignore[operator]


if __name__ == "__main__":
    sys.exit(main())
