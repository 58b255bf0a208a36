"""The gateway against the servers directly, measured by a real load tool (guidellm).

On loopback: N real llama.cpp servers (`llama-server` from the `real` extra) serving a tiny
random-weight GGUF made here, the control plane (`controlplane serve`) with one model served
by all N, and one real Envoy. guidellm (in its own venv: see README.md) then runs the same
workload both ways in each round, in the same invocation:

- **gateway**: one guidellm at the gateway, C concurrent streams, Envoy spreading them;
- **direct**: N guidellm processes at once, one per server, C/N streams each;
- **gateway-1** and **direct-1**: one stream, through the gateway (both servers idle) and to
  the first server: the per-request cost of the path alone, without balancing.

So every server has the same requests in flight either way; what differs is the path. Rounds
alternate which goes first. guidellm's default backend validation is on (it asks
`{target}/health` before it starts). Printed per phase: requests completed and failed,
throughput (requests/s, output tokens/s), TTFT p50/p99 and request latency p50; then the
gateway's figures as ratios against direct. Every process is stopped, on failure too.

    .venv/bin/python bench/real_gateway/run.py                    # 2 servers, 2 rounds, ~5 min
    .venv/bin/python bench/real_gateway/run.py --servers 3 --streams 6 --duration 60
    .venv/bin/python bench/real_gateway/run.py --envoy-defaults   # upstream connections as Envoy's defaults
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
BIN = Path(sys.executable).parent
sys.path.insert(0, str(HERE.parent / "lb_quality"))
sys.path.insert(0, str(REPO))

from real import Stack, start_proxied  # noqa: E402

from bench.ports import free_port  # noqa: E402
from controlplane.routing.clusters import HTTP_PROTOCOL_OPTIONS  # noqa: E402
from controlplane.sim import llamacpp  # noqa: E402

MODEL = "tiny"
SINGLE = "-1"  # the arms with one stream
# Every request's body: the random model never generates a byte above 0x7F. llama.cpp streams
# the bytes of an unfinished UTF-8 character as broken JSON (an invalid \u escape, an
# unterminated string), which guidellm counts as a failed request, direct or not: 3 of about
# 10,000 in a run without this. Token 3 + b is byte b in the GGUF's vocab.
ASCII_ONLY = {"logit_bias": [[3 + b, False] for b in range(0x80, 0x100)]}
PREDICTED = "llamacpp:tokens_predicted_total"
INSTALL = (
    "python3 -m venv .venv-guidellm && .venv-guidellm/bin/pip install -r bench/real_gateway/requirements.txt"
)


def guidellm_binary(given: str | None) -> str:
    """--guidellm, else $GUIDELLM, else guidellm beside this Python, in .venv-guidellm, on PATH."""
    for candidate in (given, os.environ.get("GUIDELLM")):
        if candidate:
            return candidate
    for path in (BIN / "guidellm", REPO / ".venv-guidellm" / "bin" / "guidellm"):
        if path.is_file() and os.access(path, os.X_OK):
            return str(path)
    found = shutil.which("guidellm")
    if found:
        return found
    raise SystemExit(f"guidellm not found: install it in its own venv ({INSTALL}) or pass --guidellm PATH")


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-character table (what a ByteLevel pre-tokenizer maps bytes to), by byte."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]  # "!".."~", "¡".."¬", "®".."ÿ"
    chars = dict(zip(printable, printable, strict=True))
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return [chr(chars[b]) for b in range(256)]


def write_byte_tokenizer(directory: Path) -> None:
    """A Hugging Face tokenizer (tokenizer.json, no download) in which each byte is one token,
    as in the GGUF's byte-level vocab: guidellm sizes its synthetic prompts with it."""
    directory.mkdir(parents=True, exist_ok=True)
    level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **level},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(byte_tokens())},
            "merges": [],
        },
    }
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def fleet_yaml(listener: int, servers: list[llamacpp.LlamaServer], envoy_defaults: bool) -> str:
    lines = [
        f"listener: {{port: {listener}}}",
        "tiers: {small: {max_params_b: 15, timeout: 120s}}",
        "models:",
        f"  {MODEL}:",
        "    params_b: 1",
        "    stable: v1",
    ]
    if envoy_defaults:
        # The clusters before issue 32: Envoy's defaults, connections reused and kept 1 h idle.
        lines += [
            "    cluster_overrides:",
            "      typed_extension_protocol_options:",
            f"        {HTTP_PROTOCOL_OPTIONS}:",
            f'          "@type": type.googleapis.com/{HTTP_PROTOCOL_OPTIONS}',
            "          common_http_protocol_options: {idle_timeout: 3600s}",
            "          explicit_http_config: {http_protocol_options: {}}",
        ]
    lines += ["    versions:", "      v1:", "        endpoints:"]
    lines += [f"          - {{address: '{s.address}'}}" for s in servers]
    return "\n".join(lines) + "\n"


def post_completion(base: str) -> int:
    body = json.dumps({"model": MODEL, "prompt": "up?", "max_tokens": 1}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return 0


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.2)


class Tools:
    """The guidellm processes running now (each in its own process group, with its workers)."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, args: list[str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)
        self.procs.append(p)
        return p

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.procs.clear()


@dataclass
class Phase:
    """One arm of one round, over all its guidellm processes."""

    arm: str
    completed: int
    failed: int  # guidellm's errored requests
    cut: int  # guidellm's incomplete ones: in flight when the phase's time ran out
    requests_s: float
    output_tokens_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    latency_p50_ms: float
    split: str = ""  # each server's share of the tokens generated in the phase
    errors: tuple[str, ...] = ()  # what guidellm said of its failed requests, each once


def predicted_tokens(servers: list[llamacpp.LlamaServer]) -> list[float]:
    """Each server's own count of tokens generated (llamacpp:tokens_predicted_total)."""
    counts = []
    for server in servers:
        [line] = [x for x in server.metrics().splitlines() if x.startswith(PREDICTED + " ")]
        counts.append(float(line.split()[1]))
    return counts


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def read_report(path: Path) -> tuple[list[dict[str, Any]], int, int, float, set[str]]:
    """(completed requests' stats, errored, incomplete, measured seconds, the errors) of one
    guidellm run."""
    [bench] = json.loads(path.read_text())["benchmarks"]
    totals = bench["metrics"]["request_totals"]
    errored, incomplete = int(totals["errored"]), int(totals["incomplete"])
    errors = {str((r.get("info") or {}).get("error"))[:300] for r in bench["requests"]["errored"]}
    return bench["requests"]["successful"], errored, incomplete, bench["duration"], errors


def run_phase(
    arm: str,
    targets: list[str],
    streams_each: int,
    seconds: float,
    args: argparse.Namespace,
    guidellm: str,
    tokenizer: Path,
    workdir: Path,
    tools: Tools,
    tag: str,
) -> Phase:
    """One guidellm per target, all at once; their figures combined."""
    reports = []
    for i, target in enumerate(targets):
        out = workdir / f"{tag}-{arm}-{i}.json"
        cmd = [
            guidellm,
            "run",
            "--backend",
            json.dumps(
                {"kind": "openai_http", "target": target, "model": MODEL, "extras": {"body": ASCII_ONLY}}
            ),
            "--profile",
            f"kind=concurrent,streams={streams_each},warmup={args.warmup}",
            "--constraint",
            f"kind=max_duration,seconds={seconds + args.warmup}",
            "--tokenizer",
            f"kind=huggingface_auto,model={tokenizer}",
            "--data",
            f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
            "--output",
            f"kind=json,path={out}",
            "--disable-console-interactive",
        ]
        if i == 0 and tag == "r1":
            print("  $ " + " ".join(cmd), flush=True)
        reports.append((tools.start(cmd, workdir / f"{tag}-{arm}-{i}.log", workdir), out))
    deadline = time.monotonic() + seconds + args.warmup + 180
    for p, out in reports:
        try:
            p.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"guidellm ({arm}) did not finish; see {workdir}") from None
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"guidellm ({arm}) failed with {p.returncode}; see {out.with_suffix('.log')}")
    tools.procs.clear()
    done: list[dict[str, Any]] = []
    failed = cut = 0
    rate = tokens = 0.0
    errors: set[str] = set()
    for _, out in reports:
        ok, bad, unfinished, seconds, said = read_report(out)
        errors |= said
        done += ok
        failed += bad
        cut += unfinished
        rate += len(ok) / seconds  # each process over its own window: they run side by side
        tokens += sum(r["output_tokens"] or 0 for r in ok) / seconds
    ttft = [r["time_to_first_token_ms"] for r in done if r["time_to_first_token_ms"] is not None]
    latency = [r["request_latency"] * 1000 for r in done]
    return Phase(
        arm,
        len(done),
        failed,
        cut,
        rate,
        tokens,
        percentile(ttft, 50),
        percentile(ttft, 99),
        percentile(latency, 50),
        errors=tuple(sorted(errors)),
    )


def envoy_stat(admin: int, name: str) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/stats?filter=^{name}$", timeout=5) as r:
        for line in r.read().decode().splitlines():
            key, _, value = line.partition(": ")
            if key == name:
                return int(value)
    return 0


def print_phases(phases: list[tuple[int, Phase]]) -> None:
    print(
        f"{'round':>5} {'arm':<10} {'done':>6} {'failed':>6} {'cut':>4} {'req/s':>7} {'out tok/s':>9} "
        f"{'TTFT p50 ms':>11} {'TTFT p99 ms':>11} {'latency p50 ms':>14}  split"
    )
    for r, p in phases:
        print(
            f"{r:>5} {p.arm:<10} {p.completed:>6} {p.failed:>6} {p.cut:>4} {p.requests_s:>7.2f} "
            f"{p.output_tokens_s:>9.1f} "
            f"{p.ttft_p50_ms:>11.1f} {p.ttft_p99_ms:>11.1f} {p.latency_p50_ms:>14.1f}  {p.split}"
        )


def print_ratios(phases: list[tuple[int, Phase]]) -> None:
    print("\ngateway / direct, per round (throughput below 1 and TTFT above 1 are the gateway's cost):")
    print(f"{'round':>5} {'req/s':>7} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} {'+TTFT p50 ms':>12}")
    for suffix, what in (("", "C streams over N servers"), (SINGLE, "one stream")):
        if any(p.arm == "gateway" + suffix for _, p in phases):
            print_ratio_rows(phases, suffix, what)


def print_ratio_rows(phases: list[tuple[int, Phase]], suffix: str, what: str) -> None:
    print(f"{what}:")
    rows = []
    for r in sorted({r for r, _ in phases}):
        by_arm = {p.arm: p for rr, p in phases if rr == r}
        g, d = by_arm["gateway" + suffix], by_arm["direct" + suffix]
        row = (
            g.requests_s / d.requests_s,
            g.output_tokens_s / d.output_tokens_s,
            g.ttft_p50_ms / d.ttft_p50_ms,
            g.ttft_p99_ms / d.ttft_p99_ms,
            g.ttft_p50_ms - d.ttft_p50_ms,
        )
        rows.append(row)
        print(f"{r:>5} {row[0]:>7.3f} {row[1]:>9.3f} {row[2]:>9.3f} {row[3]:>9.3f} {row[4]:>12.1f}")
    if len(rows) > 1:
        med = [statistics.median(col) for col in zip(*rows, strict=True)]
        print(f"{'med':>5} {med[0]:>7.3f} {med[1]:>9.3f} {med[2]:>9.3f} {med[3]:>9.3f} {med[4]:>12.1f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", type=int, default=2, help="llama-servers behind the model (at least 2)")
    p.add_argument("--streams", type=int, default=4, help="concurrent streams, a multiple of --servers")
    p.add_argument("--slots", type=int, default=2, help="each server's --parallel")
    p.add_argument("--rounds", type=int, default=2, help="gateway and direct phases, alternating order")
    p.add_argument("--duration", type=float, default=30.0, help="seconds measured per phase")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds per phase before measuring")
    p.add_argument(
        "--single-duration",
        type=float,
        default=15.0,
        help="seconds measured with one stream, gateway against the first server (0: none)",
    )
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--guidellm", help="the guidellm executable (default: see README.md)")
    p.add_argument(
        "--envoy-defaults",
        action="store_true",
        help="upstream connections as Envoy's defaults (reused, closed after 1 h idle), not ours",
    )
    p.add_argument("--keep", action="store_true", help="keep the work dir (logs, guidellm reports)")
    args = p.parse_args(argv)
    if args.servers < 2 or args.streams % args.servers:
        p.error("--servers must be at least 2 and divide --streams")
    lacking = llamacpp.missing()
    if lacking:
        raise SystemExit(lacking)
    binary = llamacpp.llama_server_binary()
    assert binary is not None
    guidellm = guidellm_binary(args.guidellm)

    # SIGTERM (and SIGHUP) unwind like Ctrl-C, through the finally below.
    def interrupted(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)

    workdir = Path(tempfile.mkdtemp(prefix="real-gateway-"))
    stack = Stack(workdir)
    tools = Tools()
    servers: list[llamacpp.LlamaServer] = []
    ok = False
    try:
        gguf = workdir / "tiny-random-llama.gguf"
        llamacpp.write_tiny_llama(gguf)
        tokenizer = workdir / "tokenizer"
        write_byte_tokenizer(tokenizer)
        for _ in range(args.servers):
            server = llamacpp.LlamaServer(
                binary, gguf, workdir, alias=MODEL, port=free_port(), slots=args.slots
            )
            servers.append(server)  # before start(): one that fails to start is stopped too
            server.start()
        listener = free_port()
        config = workdir / "fleet.yaml"
        config.write_text(fleet_yaml(listener, servers, args.envoy_defaults))
        start_proxied(stack, workdir, config, listener, "real-gateway")
        gateway = f"http://127.0.0.1:{listener}"
        wait_for(lambda: post_completion(gateway) == 200, 30, "the model through the gateway")
        started = time.strftime("%Y-%m-%d %H:%M")
        print(
            f"{started}: {args.servers} llama-servers ({llamacpp.DESCRIPTION}; --parallel {args.slots}), "
            f"{args.streams} streams, {args.prompt_tokens} prompt / {args.output_tokens} output tokens, "
            f"{args.warmup:g} s warm-up + {args.duration:g} s per phase; upstream connections: "
            + ("Envoy's defaults (reused, 1 h idle)" if args.envoy_defaults else "the control plane's"),
            flush=True,
        )
        phases: list[tuple[int, Phase]] = []
        for r in range(1, args.rounds + 1):
            arms = ["gateway", "direct"] if r % 2 else ["direct", "gateway"]
            if args.single_duration > 0:
                arms += [f"{a}{SINGLE}" for a in arms]
            for arm in arms:
                seconds = args.single_duration if arm.endswith(SINGLE) else args.duration
                if arm == "gateway":
                    targets, each = [gateway], args.streams
                elif arm == "direct":
                    targets, each = [s.base for s in servers], args.streams // args.servers
                else:  # one stream: through the gateway (to either idle server), or to the first
                    targets, each = [gateway if arm.startswith("gateway") else servers[0].base], 1
                before = predicted_tokens(servers)
                phase = run_phase(
                    arm, targets, each, seconds, args, guidellm, tokenizer, workdir, tools, f"r{r}"
                )
                made = [b - a for a, b in zip(before, predicted_tokens(servers), strict=True)]
                phase.split = "/".join(f"{m / (sum(made) or 1):.2f}" for m in made)
                phases.append((r, phase))
                print(f"  round {r} {arm}: {phase.completed} done, {phase.failed} failed", flush=True)
        print()
        print_phases(phases)
        print_ratios(phases)
        admin = stack.envoy_admins[0]
        print(
            "\nEnvoy: 5xx answered "
            f"{envoy_stat(admin, 'http.inference.downstream_rq_5xx')}, upstream connections closed by a "
            "server with a request on them "
            f"{envoy_stat(admin, f'cluster.{MODEL}_v1.upstream_cx_destroy_remote_with_active_rq')}"
        )
        for r, ph in phases:
            for error in ph.errors:
                print(f"round {r} {ph.arm} failed: {error}")
        ok = all(ph.failed == 0 for _, ph in phases)  # else the work dir is kept, with the logs
        return 0 if ok else 1
    finally:
        tools.stop()
        stack.stop()
        for server in servers:
            server.stop()
        if args.keep or not ok:
            print(f"work dir kept: {workdir}", file=sys.stderr)
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
