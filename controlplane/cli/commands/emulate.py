"""`controlplane emulate`: emulated GPU model servers (OpenAI API, vLLM or Triton /metrics,
runtime faults), docs/emulator.md."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from typing import Any

from controlplane.cli import argtypes


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `emulate` and its flags to `sub` (defaults from the emulator's own ServerSpec)."""
    from controlplane.sim.service import ServerSpec

    spec = ServerSpec()
    e = sub.add_parser(
        "emulate",
        help="run emulated inference servers (OpenAI API, vLLM /metrics, fault injection)",
        description="Run emulated GPU model servers: OpenAI-compatible completions with latency "
        "from a continuous-batching model, /health, vLLM-style /metrics, and runtime faults over "
        "POST /emulator/faults. Runs until SIGINT or SIGTERM. See docs/emulator.md.",
    )
    e.add_argument(
        "--listen",
        default="127.0.0.1:8000",
        metavar="HOST:PORT",
        help="address of the first server; --count N uses N consecutive ports from PORT "
        "(PORT 0: free ports chosen by the OS) (default: %(default)s, loopback only)",
    )
    e.add_argument(
        "--model", required=True, metavar="NAME", help="the model name served and checked in requests"
    )
    e.add_argument(
        "--gpu", metavar="CLASS", help="GPU class, e.g. A100 (informational: logs and /emulator/stats)"
    )
    e.add_argument(
        "--speed",
        type=argtypes.number(0, strict=True),
        default=spec.speed,
        metavar="X",
        help="relative GPU speed; prefill and decode times are divided by it (0.33 is 3x slower) "
        "(default: %(default)s)",
    )
    e.add_argument(
        "--slots",
        type=argtypes.integer(1),
        default=spec.slots,
        metavar="N",
        help="sequences decoded at once; more requests wait in FIFO order (default: %(default)s)",
    )
    e.add_argument(
        "--cold-start",
        type=argtypes.number(0),
        default=0.0,
        metavar="SECONDS",
        help="/health and the API answer 503 this long after start (default: %(default)s)",
    )
    e.add_argument(
        "--count",
        type=argtypes.integer(1),
        default=1,
        metavar="N",
        help="servers to run (default: %(default)s)",
    )
    e.add_argument(
        "--prefill-ms-per-token",
        type=argtypes.number(0),
        default=spec.prefill_s_per_token * 1000,
        metavar="MS",
        help="prefill time per prompt token at speed 1 (default: %(default)s)",
    )
    e.add_argument(
        "--decode-ms-per-token",
        type=argtypes.number(0, strict=True),
        default=spec.decode_s_per_token * 1000,
        metavar="MS",
        help="decode time per output token at speed 1 (default: %(default)s)",
    )
    e.add_argument(
        "--kv-capacity-tokens",
        type=argtypes.integer(1),
        default=spec.kv_capacity_tokens,
        metavar="N",
        help="KV-cache size in tokens; KV use = tokens held by running sequences / N (default: %(default)s)",
    )
    e.add_argument(
        "--kv-events",
        default=None,
        metavar="ENDPOINT",
        help="publish KV events as vLLM does (--kv-events-config), bound at this ZMQ endpoint, "
        "such as tcp://127.0.0.1:5557: a batch per change of the prefix cache (default: none)",
    )
    e.add_argument(
        "--kv-replay",
        default=None,
        metavar="ENDPOINT",
        help="the KV events' replay socket (vLLM's replay_endpoint), with --kv-events (default: none)",
    )
    e.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="tokenize prompts with this Hugging Face tokenizer directory (tokenizer.json, "
        "tokenizer_config.json's chat template), as a vLLM of that model does; the KV events "
        "carry its token ids (default: a word is a token)",
    )
    e.add_argument(
        "--max-tokens",
        type=argtypes.integer(1, 4096),
        default=16,
        metavar="N",
        help="output tokens of a request that sets no max_tokens, 1-4096 (default: %(default)s)",
    )
    e.add_argument(
        "--phantom-output-tokens",
        type=argtypes.integer(1),
        default=256,
        metavar="N",
        help="output tokens of each phantom request the `backlog` fault queues; with the decode "
        "time this sets how long a backlog holds real requests (default: %(default)s)",
    )
    e.add_argument(
        "--error-rate",
        type=argtypes.number(0, 1),
        default=0.0,
        metavar="P",
        help="fraction of requests answered 500, 0-1 (default: %(default)s)",
    )
    e.add_argument(
        "--oom-rate",
        type=argtypes.number(0, 1),
        default=0.0,
        metavar="P",
        help="fraction of requests answered 507 (out of memory), 0-1 (default: %(default)s)",
    )
    e.add_argument(
        "--slow",
        type=argtypes.number(0, strict=True),
        default=1.0,
        metavar="X",
        help="multiplier on service time, on top of --speed (default: %(default)s)",
    )
    e.add_argument(
        "--crash-after",
        type=argtypes.number(0, strict=True),
        metavar="SECONDS",
        help="crash every server this long after start: the port then refuses connections (default: never)",
    )
    e.add_argument(
        "--seed", type=int, metavar="INT", help="seed for the error and OOM draws (default: random)"
    )
    e.add_argument(
        "--metrics-page",
        choices=["full", "compact", "triton"],
        default="full",
        help="the /metrics page: full has the families of a vLLM 0.32 server (16 histograms, about "
        "35 KB, as a real page's); compact 11 of them (5 histograms, about 14 KB); "
        "triton a Triton Inference Server's nv_inference_* families (failures counted, no "
        "histogram). The vLLM families the control plane reads are the same in full and compact "
        "(default: %(default)s)",
    )
    e.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve /metrics (and /health) on this port instead of the serving port, as Triton "
        "does on 8002; 0 picks a free one (default: on the serving port). With --count, each "
        "server gets PORT+i",
    )
    e.add_argument(
        "--lora-modules",
        nargs="+",
        default=(),
        metavar="NAME[=PATH]",
        help="LoRA adapters registered at start, as vLLM's --lora-modules: a request whose model "
        "names one is served with it (docs/emulator.md#lora-adapters; default: none, LoRA off)",
    )
    e.add_argument(
        "--max-loras",
        type=int,
        default=None,
        metavar="N",
        help="adapters held in GPU slots at once, as vLLM's --max-loras; a request for another waits "
        "for a slot and its load (default: 1 with --lora-modules, else LoRA off)",
    )
    e.add_argument(
        "--lora-load-s",
        type=argtypes.number(0),
        default=0.5,
        metavar="SECONDS",
        help="what loading an adapter into a slot costs its request (default: %(default)s)",
    )
    e.add_argument(
        "--no-runtime-lora",
        action="store_true",
        help="no POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM without "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING; default: they answer)",
    )
    e.add_argument("--log-format", choices=["console", "json"], default="console", help="log output format")
    e.add_argument("--log-level", default="info", help="debug, info, warning, error (default: info)")


def run(args: argparse.Namespace) -> int:
    """`controlplane emulate`: check the flags (exit 2), then run the servers until a signal."""
    from controlplane.obs.http import split_host_port
    from controlplane.obs.logging import configure_logging
    from controlplane.sim.emulator import Faults, FaultsInvalid

    configure_logging(args.log_format, args.log_level)
    try:
        host, port = split_host_port(args.listen)
    except ValueError as e:
        print(f"controlplane emulate: --listen: {e}", file=sys.stderr)
        return 2
    if port > 65535 or (port and port + args.count - 1 > 65535):
        print(
            f"controlplane emulate: --listen: ports {port}..{port + args.count - 1} go beyond 65535",
            file=sys.stderr,
        )
        return 2
    try:
        faults = Faults(slow=args.slow, error_rate=args.error_rate, oom_rate=args.oom_rate)
    except FaultsInvalid as e:
        print(f"controlplane emulate: --{(e.field or '').replace('_', '-')}: {e}", file=sys.stderr)
        return 2
    try:
        config = _config(args, faults)
    except ValueError as e:
        print(f"controlplane emulate: {e}", file=sys.stderr)
        return 2
    if args.tokenizer:
        from controlplane.kvcache.prompt import PromptError, Tokenizers

        try:
            Tokenizers(max_chars=None).get(args.tokenizer)
        except PromptError as e:
            print(f"controlplane emulate: --tokenizer: {e}", file=sys.stderr)
            return 2
    if args.kv_replay and not args.kv_events:
        print(
            "controlplane emulate: --kv-replay: needs --kv-events (the publisher it replays)", file=sys.stderr
        )
        return 2
    if args.kv_events and args.count != 1:
        print(
            "controlplane emulate: --kv-events: one server only (--count 1): each needs its own",
            file=sys.stderr,
        )
        return 2
    ports = [port + i if port else 0 for i in range(args.count)]
    with contextlib.suppress(KeyboardInterrupt):
        mports = (
            None
            if args.metrics_port is None
            else [args.metrics_port + i if args.metrics_port else 0 for i in range(args.count)]
        )
        return asyncio.run(_run_emulators_until_signal(config, host, ports, args.crash_after, mports))
    return 0


def _config(args: argparse.Namespace, faults: Any) -> Any:
    """The servers' EmulatorConfig from the flags; ValueError naming the field if one is bad."""
    from controlplane.sim.emulator import EmulatorConfig

    return EmulatorConfig(
        model=args.model,
        gpu=args.gpu,
        speed=args.speed,
        slots=args.slots,
        prefill_s_per_token=args.prefill_ms_per_token / 1000,
        decode_s_per_token=args.decode_ms_per_token / 1000,
        kv_capacity_tokens=args.kv_capacity_tokens,
        cold_start_s=args.cold_start,
        default_max_tokens=args.max_tokens,
        phantom_output_tokens=args.phantom_output_tokens,
        faults=faults,
        seed=args.seed,
        metrics_page=args.metrics_page,
        kv_events=args.kv_events,
        kv_replay=args.kv_replay,
        tokenizer=args.tokenizer,
        lora_modules=tuple(args.lora_modules),
        max_loras=args.max_loras,
        lora_load_s=args.lora_load_s,
        allow_runtime_lora=not args.no_runtime_lora,
    )


async def _run_emulators_until_signal(
    config: object,
    host: str,
    ports: list[int],
    crash_after: float | None,
    metrics_ports: list[int] | None = None,
) -> int:
    import structlog

    from controlplane.process.stop import until_stop_signal
    from controlplane.sim.emulator import EmulatorConfig, Emulators

    assert isinstance(config, EmulatorConfig)
    log = structlog.get_logger("controlplane.emulate")
    emulators = Emulators([config] * len(ports), host, ports, metrics_ports)
    try:
        await emulators.start()
    except OSError as e:
        print(f"controlplane emulate: {e}", file=sys.stderr)
        return 2
    for server in emulators:
        log.info(
            "emulated server started",
            address=server.address,
            metrics_port=server.metrics_port,
            model=config.model,
            gpu=config.gpu,
            speed=config.speed,
            slots=config.slots,
            cold_start_s=config.cold_start_s,
        )

    async def crash_later() -> None:
        assert crash_after is not None
        await asyncio.sleep(crash_after)
        for server in emulators:
            await server.crash(reason="--crash-after")  # logs that it goes down

    crasher = asyncio.create_task(crash_later()) if crash_after is not None else None
    await until_stop_signal()
    if crasher is not None:
        crasher.cancel()
    await emulators.stop()
    log.info("emulated servers stopped", count=len(emulators))
    return 0
