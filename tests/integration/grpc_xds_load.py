"""Calls through grpcio's own xDS client, as a proxyless gRPC user runs it (integration tests).

Usage: GRPC_XDS_BOOTSTRAP=... python grpc_xds_load.py TARGET [--calls N | --seconds S]
       [--rate R] [--concurrency C] [--wait-ready] [--deadline S] [--csds] [--header K=V]

Each call is the unary method /inference.Who/Call with raw bytes; a backend answers with its
own name. With --wait-ready it calls until one succeeds (with --ready-backends N, until N backends
answered; 30 s at most) and prints "ready"
(those calls send READY_PROBE, which the tests' servers answer without their `sleep_s`);
with --csds it serves gRPC's own CSDS service (grpc_csds, the client's view of its xDS
config) on a loopback port and prints "csds PORT". Then it makes its calls and prints one
JSON line: calls per backend, failures per status code, and each call's (start offset,
seconds, backend or code). With --csds it then waits for a line on stdin before exiting.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from concurrent import futures

import grpc

METHOD = "/inference.Who/Call"
READY_PROBE = b"ready?"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("target")
    p.add_argument("--calls", type=int, default=0)
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--rate", type=float, default=0.0, help="calls per second (0: back to back)")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--deadline", type=float, default=None, help="each call's own deadline")
    p.add_argument("--wait-ready", action="store_true")
    p.add_argument(
        "--ready-backends",
        type=int,
        default=1,
        help="with --wait-ready: probe until this many backends answered (round robin sends a "
        "channel's calls only to the backends it has connected to)",
    )
    p.add_argument("--csds", action="store_true")
    p.add_argument("--header", action="append", default=[], help="K=V metadata on every call")
    p.add_argument("--key-header", help="call i sends this header with the value key-(i mod --keys)")
    p.add_argument("--keys", type=int, default=1)
    args = p.parse_args()
    metadata = tuple(tuple(h.split("=", 1)) for h in args.header)

    csds_server = None
    if args.csds:
        import grpc_csds  # gRPC's own CSDS service, in the client's process

        csds_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        grpc_csds.add_csds_servicer(csds_server)
        port = csds_server.add_insecure_port("127.0.0.1:0")
        csds_server.start()
        print(f"csds {port}", flush=True)

    channel = grpc.insecure_channel(args.target)
    call = channel.unary_unary(METHOD)
    if args.wait_ready:
        give_up = time.monotonic() + 30
        answered: set[str] = set()  # the backends that answered a probe
        last = ""  # the last probe's failure
        while len(answered) < args.ready_backends:
            if time.monotonic() > give_up:
                print(f"never ready: {last or f'only {sorted(answered)} answered'}", flush=True)
                return 1
            try:
                answered.add(call(READY_PROBE, timeout=5).decode())
            except grpc.RpcError as e:
                last = f"{e.code()} {e.details()}"
            if len(answered) < args.ready_backends:
                time.sleep(0.02)  # the probes' pace, until the deadline above
        print("ready", flush=True)

    backends: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    details: dict[str, str] = {}
    trace: list[tuple[float, float, str]] = []
    lock = threading.Lock()
    start = time.monotonic()
    interval = 1.0 / args.rate if args.rate else 0.0
    issued = 0
    by_key: dict[str, Counter[str]] = {}

    def next_slot() -> tuple[float, int] | None:
        """When the next call may start and its number, or None when the run is over."""
        nonlocal issued
        with lock:
            if args.calls and issued >= args.calls:
                return None
            at = start + issued * interval
            if args.seconds and at - start >= args.seconds:
                return None
            issued += 1
            return at, issued - 1

    def worker() -> None:
        while (slot := next_slot()) is not None:
            at, i = slot
            md = metadata
            key = ""
            if args.key_header:
                key = f"key-{i % args.keys}"
                md = (*metadata, (args.key_header, key))
            delay = at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            t0 = time.monotonic()
            try:
                who = call(b"hello", timeout=args.deadline, metadata=md).decode()
                outcome = who
            except grpc.RpcError as e:
                outcome = e.code().name
                with lock:
                    details.setdefault(outcome, e.details() or "")
            took = time.monotonic() - t0
            with lock:
                (backends if not outcome.isupper() else codes)[outcome] += 1
                if key:
                    by_key.setdefault(key, Counter())[outcome] += 1
                trace.append((round(t0 - start, 4), round(took, 4), outcome))

    threads = [threading.Thread(target=worker) for _ in range(max(1, args.concurrency))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    trace.sort()
    print(
        json.dumps(
            {"backends": backends, "codes": codes, "details": details, "trace": trace, "by_key": by_key}
        ),
        flush=True,
    )
    if csds_server is not None:
        sys.stdin.readline()
        csds_server.stop(0)
    channel.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
