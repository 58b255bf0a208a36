"""A shared-prefix chat workload, open loop; prints one JSON summary line.

In the style of the SGLang and llm-d prefix-caching benchmarks: `--systems` system prompts
(long, `--system-words` words each) x `--sessions` conversations each. An arrival (Poisson,
`--rate` per second) is the next turn of a random conversation: its messages are the system
prompt, then every earlier turn (user and assistant), then a new user turn; after `--turns`
turns a conversation starts over. A share `--unique-share` of requests have a system prompt
of their own (no common prefix). Requests stream; TTFT is the time to the first chunk.

Every request carries `x-session-id` (its conversation), so a session-hashing policy can
use it. With `--oracle-servers N`, the summary also gives the hit ratio of an oracle that
sends each request to the server whose prefix cache (the emulator's model: 16-token blocks,
an LRU of `--oracle-kv-tokens / 16`) holds its longest prefix, ties to the server sent the
fewest tokens: what a per-request cache-aware picker would get, load aside.
Run as its own process, so the load and the system under test do not share a GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from controlplane.sim.prefix_cache import PrefixCache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from loadgen import open_loop, output_tokens, percentile


def words(rng: random.Random, n: int, tag: str) -> str:
    return " ".join(f"{tag}{rng.randrange(10_000)}" for _ in range(n))


@dataclass
class Conversation:
    system: str
    sid: str
    turns: list[tuple[str, str]] = field(default_factory=list)


class Workload:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.systems = [words(self.rng, args.system_words, f"sys{i}w") for i in range(args.systems)]
        self.conversations = [
            Conversation(self.systems[i], f"s{i}-c{j}-0")
            for i in range(args.systems)
            for j in range(args.sessions)
        ]
        self.unique = 0

    def next_request(self) -> tuple[str, list[dict[str, str]]]:
        """(session id, messages) of the next request."""
        a = self.args
        if self.rng.random() < a.unique_share:
            self.unique += 1
            sid = f"unique-{self.unique}"
            system = words(self.rng, a.system_words, f"u{self.unique}w")
            return sid, [
                {"role": "system", "content": system},
                {"role": "user", "content": words(self.rng, a.turn_words, "q")},
            ]
        c = self.rng.choice(self.conversations)
        if len(c.turns) >= a.turns:
            gen = int(c.sid.rsplit("-", 1)[1]) + 1
            c.sid, c.turns = f"{c.sid.rsplit('-', 1)[0]}-{gen}", []
        messages = [{"role": "system", "content": c.system}]
        for user, assistant in c.turns:
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        user = words(self.rng, a.turn_words, "q")
        messages.append({"role": "user", "content": user})
        c.turns.append((user, words(self.rng, a.turn_words, "a")))
        return c.sid, messages


def tokens_of(messages: list[dict[str, str]]) -> list[str]:
    """The emulator's tokenizer over a chat (sim/emulator_protocol.py): the words of every content."""
    out: list[str] = []
    for m in messages:
        out += m["content"].split()
    return out


class Oracle:
    """A cache-aware per-request picker over simulated caches, load aside."""

    def __init__(self, servers: int, kv_tokens: int) -> None:
        self.caches = [PrefixCache(kv_tokens // 16) for _ in range(servers)]
        self.sent = [0] * servers
        self.warmup_queries = self.warmup_hits = 0  # what the warm-up looked up (measure())

    def measure(self) -> None:
        """The measured window starts: what the caches counted so far was the warm-up."""
        self.warmup_queries = sum(c.queries for c in self.caches)
        self.warmup_hits = sum(c.hits for c in self.caches)

    def pick(self, tokens: list[str]) -> None:
        best = max(range(len(self.caches)), key=lambda i: (self.caches[i].peek(tokens), -self.sent[i]))
        self.caches[best].admit(tokens)
        self.sent[best] += len(tokens)

    @property
    def hit_ratio(self) -> float:
        """Over the measured window (after the warm-up)."""
        q = sum(c.queries for c in self.caches) - self.warmup_queries
        return (sum(c.hits for c in self.caches) - self.warmup_hits) / q if q else float("nan")

    @property
    def hit_ratio_all(self) -> float:
        """Warm-up included."""
        q = sum(c.queries for c in self.caches)
        return sum(c.hits for c in self.caches) / q if q else float("nan")


async def run(args: argparse.Namespace) -> dict[str, object]:
    wl = Workload(args)
    oracle = Oracle(args.oracle_servers, args.oracle_kv_tokens) if args.oracle_servers else None
    rng = random.Random(args.seed + 1)
    url = f"http://{args.target}/v1/chat/completions"
    ttfts: list[float] = []
    latencies: list[float] = []
    statuses: dict[str, int] = {}
    by_server: dict[str, int] = {}

    async def one(
        session: aiohttp.ClientSession, sid: str, messages: list[dict[str, str]], tokens: int, measure: bool
    ) -> None:
        body = {"model": args.model, "messages": messages, "max_tokens": tokens, "stream": True}
        start = time.monotonic()
        first = None
        try:
            async with session.post(url, json=body, headers={"x-session-id": sid}) as resp:
                server = resp.headers.get("x-emulator-server", "")
                async for _chunk in resp.content.iter_any():
                    if first is None:
                        first = time.monotonic() - start
                status = str(resp.status)
        except Exception as e:  # a failed request is a result
            status, server = type(e).__name__, ""
        if not measure:
            return
        statuses[status] = statuses.get(status, 0) + 1
        if status == "200" and first is not None:
            ttfts.append(first)
            latencies.append(time.monotonic() - start)
            by_server[server] = by_server.get(server, 0) + 1

    measuring: list[bool] = []
    timeout = aiohttp.ClientTimeout(total=args.timeout)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        def launch(measure: bool) -> Coroutine[Any, Any, None]:
            if measure and not measuring:  # the first measured arrival: the warm-up is over
                measuring.append(True)
                if oracle is not None:
                    oracle.measure()
                if args.measure_marker is not None:
                    args.measure_marker.touch()
            sid, messages = wl.next_request()
            if oracle is not None:
                oracle.pick(tokens_of(messages))
            # Drawn here, in arrival order (open_loop calls launch at each arrival), so every
            # run with the same seed sends the same requests at the same times.
            tokens = (
                output_tokens(rng, args.tokens_median, args.tokens_sigma, 1, args.tokens_max)
                if args.tokens_median
                else rng.randint(8, 40)
            )
            return one(session, sid, messages, tokens, measure)

        await open_loop(rng, args.rate, args.warmup, args.duration, launch)
    ok = statuses.get("200", 0)
    counts = list(by_server.values())
    return {
        "requests": sum(statuses.values()),
        "ok": ok,
        "errors": sum(statuses.values()) - ok,
        "statuses": statuses,
        "throughput": ok / args.duration,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p90": percentile(ttfts, 0.9),
        "ttft_p99": percentile(ttfts, 0.99),
        "latency_p50": percentile(latencies, 0.5),
        "latency_p90": percentile(latencies, 0.9),
        "latency_p99": percentile(latencies, 0.99),
        "by_server": by_server,
        "max_over_mean": max(counts) / (sum(counts) / len(counts)) if counts else float("nan"),
        "oracle_hit_ratio": oracle.hit_ratio if oracle is not None else None,
        "oracle_hit_ratio_all": oracle.hit_ratio_all if oracle is not None else None,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="HOST:PORT of the Envoy listener")
    p.add_argument("--model", required=True)
    p.add_argument("--rate", type=float, required=True, help="mean arrivals per second")
    p.add_argument("--duration", type=float, default=40.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=10.0, help="seconds of load before measuring")
    p.add_argument("--systems", type=int, default=8, help="shared system prompts")
    p.add_argument("--sessions", type=int, default=4, help="conversations per system prompt")
    p.add_argument("--turns", type=int, default=6, help="turns before a conversation starts over")
    p.add_argument("--system-words", type=int, default=600, help="words (tokens) per system prompt")
    p.add_argument("--turn-words", type=int, default=30, help="words per user or assistant turn")
    p.add_argument("--unique-share", type=float, default=0.1, help="share of requests with no common prefix")
    p.add_argument(
        "--oracle-servers", type=int, default=0, help="simulate a cache-aware oracle over N servers"
    )
    p.add_argument(
        "--oracle-kv-tokens", type=int, default=200_000, help="each oracle server's cache, in tokens"
    )
    p.add_argument(
        "--tokens-median",
        type=float,
        default=0.0,
        help="output tokens from loadgen.py's lognormal with this median (default: 8-40 uniform)",
    )
    p.add_argument("--tokens-sigma", type=float, default=0.9)
    p.add_argument("--tokens-max", type=int, default=400)
    p.add_argument(
        "--measure-marker",
        type=Path,
        help="a file touched when the measured window starts (after --warmup): the caller reads "
        "the servers' counters then",
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0)
    args = p.parse_args(argv)
    print(json.dumps(asyncio.run(run(args))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
