"""`controlplane demo --servers llama.cpp`, run as a user runs it: the demo's story on real
llama-server processes (issue 32, item 7). It exits 0 with no failed request and a completed
rollout; the control plane read every server's load from its real page; each server's own
/metrics counted the tokens it generated for the demo's requests; and no llama-server
outlives the demo, whether it ends, is interrupted or is killed outright.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.harness import BIN
from tests.integration.test_demo import demo_logs_in_tmp_path  # noqa: F401 (autouse: logs in tmp_path)

pytestmark = [pytest.mark.real, pytest.mark.envoy]

MAX_TOKENS = 8  # what each of the demo's requests asks for
DEMO = [str(BIN / "controlplane"), "demo", "--servers", "llama.cpp", "--no-live"]


def _pairs(line: str, after: str) -> dict[str, str]:
    return dict(kv.strip().split("=", 1) for kv in line.split(after, 1)[1].split(","))


def _processes_mentioning(text: str) -> list[int]:
    """The processes whose command line holds `text` (the demo's work directory: every
    llama-server's --model is a GGUF written there, and the control plane's --config)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        program = Path(cmdline.split(" ", 1)[0]).name
        if text in cmdline and int(proc.name) != os.getpid() and "pytest" not in program:
            found.append(int(proc.name))
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def test_the_demo_runs_its_story_on_real_llamacpp_servers(llama_binary: str) -> None:
    out = subprocess.run([*DEMO, "--duration", "20"], capture_output=True, text=True, timeout=180)
    text = out.stdout
    assert out.returncode == 0, text[-4000:] + out.stderr[-3000:]
    assert "8 real llama.cpp servers (llama-server" in text
    assert ", 0 failed" in text
    assert "rollout: llama-3-8b -> v2: Completed" in text
    lines = text.splitlines()
    work = next(line.split("demo: fleet config ", 1)[1] for line in lines if "fleet config" in line)
    work = str(Path(work).parent)

    pids = {
        n: int(p) for n, p in _pairs(next(x for x in lines if "llama-server pids " in x), " pids ").items()
    }
    cold = next(x for x in lines if "llama-cold: its llama-server started (pid " in x)  # started late
    pids["llama-cold"] = int(cold.split("(pid ", 1)[1].split(")", 1)[0])
    assert len(pids) == 9  # 8 in the fleet at first, llama-d added by the live edit

    # The control plane read the load of every server from its llamacpp:* page: running and
    # waiting numbers (requests_processing, requests_deferred), "-" only before a page was read.
    loads = [_pairs(x, "never read) ") for x in lines if " load (running+waiting" in x]
    assert loads[0]["llama-cold"] == "-+-"  # its port closed: nothing read yet
    for name, figure in loads[-1].items():
        assert re.fullmatch(r"\d+\+\d+", figure), (name, loads[-1])
    weights = [{k: int(v) for k, v in _pairs(x, " weights ").items()} for x in lines if " weights " in x]
    assert weights[0]["llama-cold"] == 0  # held out while its server was not up
    assert weights[-1]["llama-cold"] > 0  # in once it was
    assert weights[-1]["llama-b"] < weights[-1]["llama-a"] / 2  # the L4, 3x the layers

    # Each server's own /metrics, read by the demo at the end: the tokens it generated. Every
    # request asked for MAX_TOKENS; all of them were answered by these servers, none elsewhere.
    tokens = {}
    for line in lines:
        m = re.match(
            r"demo: (\S+): llama-server pid (\d+) on 127\.0\.0\.1:\d+: llamacpp:tokens_predicted_total (\d+)",
            line,
        )
        if m:
            assert int(m[2]) == pids[m[1]]
            tokens[m[1]] = int(m[3])
    assert set(tokens) == set(pids), tokens
    total = int(re.search(r"total (\d+) requests, 0 failed", text)[1])  # type: ignore[index]
    assert total > 100
    assert 0.5 * MAX_TOKENS * total <= sum(tokens.values()) <= MAX_TOKENS * total, (tokens, total)
    for name in ("llama-a", "llama-d", "llama-v2a", "qwen-a", "big-a"):
        assert tokens[name] > 0, (name, tokens)
    assert "surge skipped with --servers llama.cpp" in text

    assert _processes_mentioning(work) == []
    assert [n for n, pid in pids.items() if _alive(pid)] == [], "a llama-server outlived the demo"
    assert len(list(Path(work).glob("llama-server-*.log"))) == 9  # the logs kept,
    assert list(Path(work).glob("*.gguf")) == []  # the models not


def _until_traffic(p: subprocess.Popen[str]) -> tuple[str, str]:
    """Read the demo's output until its traffic starts; return its work directory and output."""
    seen = []
    assert p.stdout is not None
    for line in p.stdout:
        seen.append(line)
        if "traffic for" in line:
            break
    work = next(x.split("demo: fleet config ", 1)[1].strip() for x in seen if "fleet config" in x)
    return str(Path(work).parent), "".join(seen)


@pytest.mark.parametrize("how", ["ctrl-c", "sigkill"])
def test_no_llama_server_outlives_a_demo_stopped_midway(llama_binary: str, how: str) -> None:
    """Ctrl-C: the demo stops everything and exits 130. SIGKILL: no cleanup runs; the kernel
    stops the servers (parent-death signal)."""
    p = subprocess.Popen(
        [*DEMO, "--duration", "60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    work = ""
    try:
        work, seen = _until_traffic(p)
        started = _processes_mentioning(work)
        assert len(started) >= 8 + 2, seen  # the servers, the control plane, Envoy's bootstrap
        if how == "ctrl-c":
            p.send_signal(signal.SIGINT)
            rest = p.communicate(timeout=60)[0]
            assert p.returncode == 130, rest[-2000:]
            assert "interrupted; stopping everything" in rest
        else:
            p.kill()
            p.wait(10)
        deadline = time.monotonic() + 15
        while _processes_mentioning(work) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _processes_mentioning(work) == [], "a process the demo started outlived it"
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)
        for pid in _processes_mentioning(work) if work else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
