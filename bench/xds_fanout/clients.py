"""Simulated Envoy ADS clients, many per process, each on its own HTTP/2 connection.

Each subscribes the way Envoy does: CDS and LDS wildcard, then EDS for every cluster and
RDS for the listener's route, ACKing every response. Prints one line per event:
  sync STREAM T BYTES      the stream holds every type (T: monotonic time)
  eds STREAM T BYTES       an EDS response after sync
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import DELTA_METHOD, SOTW_METHOD
from envoy.config.cluster.v3 import cluster_pb2
from envoy.service.discovery.v3 import discovery_pb2

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"


def say(line: str) -> None:
    sys.stdout.write(line + "\n")


async def stream(target: str, sid: str, delta: bool, ready: asyncio.Event) -> None:
    """One proxy. If it has not synced within 30 s (a connection lost in a connection storm
    hangs without an error), it starts over, as Envoy does after its initial fetch timeout."""
    for attempt in range(5):
        synced = asyncio.Event()
        task = asyncio.create_task(_stream(target, sid, delta, synced))
        waiter = asyncio.create_task(synced.wait())
        # Synced, or the stream ended first (a server not up yet fails at once): whichever
        # comes first, not a 30 s wait for a sync that cannot come.
        done, _ = await asyncio.wait({task, waiter}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if not done:
            task.cancel()
            waiter.cancel()
            say(f"retry {sid} {attempt} no-sync")
            continue
        waiter.cancel()
        try:
            await task
            return
        except grpc.aio.AioRpcError as e:
            say(f"retry {sid} {attempt} {e.code().name}")
            await asyncio.sleep(0.5 * (attempt + 1))


async def _stream(target: str, sid: str, delta: bool, synced: asyncio.Event) -> None:
    channel = grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
    try:
        await _exchange(channel, sid, delta, synced)
    finally:
        await channel.close()


async def _exchange(channel: grpc.aio.Channel, sid: str, delta: bool, synced_event: asyncio.Event) -> None:
    Req = discovery_pb2.DeltaDiscoveryRequest if delta else discovery_pb2.DiscoveryRequest
    Resp = discovery_pb2.DeltaDiscoveryResponse if delta else discovery_pb2.DiscoveryResponse
    call = channel.stream_stream(
        DELTA_METHOD if delta else SOTW_METHOD,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=lambda b: b,
    )()
    subs: dict[str, list[str]] = {}

    def request(
        type_url: str, nonce: str = "", names: list[str] | None = None, new: list[str] | None = None
    ) -> object:
        if delta:
            return Req(type_url=type_url, response_nonce=nonce, resource_names_subscribe=new or [])
        return Req(type_url=type_url, response_nonce=nonce, resource_names=names or [])

    first = request(CLUSTER)
    first.node.id = sid  # type: ignore[attr-defined]
    await call.write(first)
    await call.write(request(LISTENER))
    have: set[str] = set()
    eds_pending: set[str] = set()
    synced = False
    total = 0
    while True:
        raw = await call.read()
        if raw is grpc.aio.EOF:
            return
        total += len(raw)
        r = Resp.FromString(raw)
        t = r.type_url
        await call.write(request(t, r.nonce, subs.get(t)))
        if t == CLUSTER and not synced:
            names = sorted(
                (x.name if delta else cluster_pb2.Cluster.FromString(x.value).name) for x in r.resources
            )
            subs[ENDPOINT] = names
            eds_pending = set(names)
            await call.write(request(ENDPOINT, "", names, names))
        elif t == LISTENER and ROUTE not in subs:
            subs[ROUTE] = ["inference"]
            await call.write(request(ROUTE, "", ["inference"], ["inference"]))
        elif t == ENDPOINT:
            if synced:
                say(f"eds {sid} {time.monotonic():.6f} {len(raw)}")
                continue
            eds_pending -= {x.name for x in r.resources} if delta else set(eds_pending)
        have.add(t)
        if not synced and len(have) == 4 and not eds_pending:
            synced = True
            synced_event.set()
            say(f"sync {sid} {time.monotonic():.6f} {total}")
            sys.stdout.flush()


async def main_async(args: argparse.Namespace) -> None:
    ready = asyncio.Event()
    tasks = []
    for i in range(args.streams):
        tasks.append(asyncio.create_task(stream(args.target, f"{args.worker}-{i}", args.delta, ready)))
        if i % 50 == 49:
            await asyncio.sleep(0.02)  # pace connection setup: a SYN flood loses connections

    async def flusher() -> None:
        while True:
            await asyncio.sleep(0.05)
            sys.stdout.flush()

    flush = asyncio.create_task(flusher())
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.readline)  # the driver closes stdin to stop us
    flush.cancel()
    for t in tasks:
        t.cancel()
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--streams", type=int, required=True)
    p.add_argument("--worker", default="w0")
    p.add_argument("--delta", action="store_true")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
