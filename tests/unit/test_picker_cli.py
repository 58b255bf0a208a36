"""`controlplane picker`'s flags are checked before anything starts, each refusal one line
naming the flag (cli/commands/picker.py's check): TLS files, listening beyond loopback without
client certificates, peers without a credential, token files that are not there."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane.cli.commands.picker import check
from controlplane.cli.main import _parser
from controlplane.net.tls import ServerTls
from tests.certs import make_certs


def _args(*flags: str) -> object:
    return _parser().parse_args(["picker", "--control-plane", "127.0.0.1:18000", *flags])


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certs(tmp_path_factory.mktemp("certs"), ("picker",))


def _refusal(*flags: str) -> str:
    with pytest.raises(ValueError) as e:
        check(_args(*flags))  # type: ignore[arg-type]
    text = str(e.value)
    assert "\n" not in text
    return text


def test_the_defaults_listen_on_loopback_in_plaintext() -> None:
    assert check(_args()) == (None, None, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("listen", ["0.0.0.0:18090", "10.1.2.3:18090", "[::]:18090", ":18090"])
def test_beyond_loopback_without_client_certificates_is_refused(listen: str, certs: Path) -> None:
    why = _refusal("--listen", listen)
    assert why.startswith(f"--listen {listen} is reachable from other machines")
    assert "--tls-client-ca" in why and "--allow-unauthenticated-clients" in why and "#trust" in why
    # Server TLS alone does not say who the client is: still refused.
    why = _refusal(
        "--listen", listen, "--tls-cert", str(certs / "picker.pem"), "--tls-key", str(certs / "picker.key")
    )
    assert "reachable from other machines" in why


def test_beyond_loopback_with_mutual_tls_or_the_explicit_opt_out(certs: Path) -> None:
    tls, _, _ = check(
        _args(  # type: ignore[arg-type]
            "--listen", "0.0.0.0:18090", "--tls-cert", str(certs / "picker.pem"),
            "--tls-key", str(certs / "picker.key"), "--tls-client-ca", str(certs / "ca.pem"),
        )
    )  # fmt: skip
    assert tls == ServerTls(certs / "picker.pem", certs / "picker.key", certs / "ca.pem")
    assert check(_args("--listen", "0.0.0.0:18090", "--allow-unauthenticated-clients")) == (None, None, None)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (("--tls-cert", "{d}/picker.pem"), "--tls-cert and --tls-key go together"),
        (("--tls-client-ca", "{d}/ca.pem"), "--tls-cert and --tls-key go together"),
        (("--tls-cert", "{d}/nope.pem", "--tls-key", "{d}/picker.key"),
         "--tls-cert {d}/nope.pem: cannot read"),
        (("--tls-cert", "{d}/picker.key", "--tls-key", "{d}/picker.pem"),
         "--tls-key {d}/picker.pem: no PRIVATE KEY"),
        (("--tls-cert", "{d}/picker.pem", "--tls-key", "{d}/picker.key", "--tls-client-ca", "{d}/picker.ext"),
         "--tls-client-ca {d}/picker.ext: not a PEM file"),
        (("--peers", "127.0.0.1:18092"), "--peers: a peer's counts steer picks"),
        (("--peers", "127.0.0.1:18092", "--tls-cert", "{d}/picker.pem", "--tls-key", "{d}/picker.key",
          "--peer-token-file", "{d}/token"), "--peers over TLS needs --tls-client-ca"),
        (("--peer-server-name", "picker"), "--peer-server-name needs --tls-client-ca"),
        (("--admin", "127.0.0.1:18001"), "--admin needs --token-file"),
        (("--admin", "127.0.0.1:18001", "--token-file", "{d}/missing"),
         "--token-file {d}/missing: cannot read (No such file or directory)"),
        (("--peers", "127.0.0.1:18092", "--peer-token-file", "{d}/empty"),
         "--peer-token-file {d}/empty: empty"),
        (("--listen", "nowhere"), "--listen: expected HOST:PORT"),
        (("--metrics-listen", "127.0.0.1"), "--metrics-listen: expected HOST:PORT"),
    ],
)  # fmt: skip
def test_each_refusal_names_its_flag(flags: tuple[str, ...], words: str, certs: Path) -> None:
    (certs / "token").write_text("shared\n")
    (certs / "empty").write_text("  \n")
    why = _refusal(*(f.format(d=certs) for f in flags))
    assert words.format(d=certs) in why, why


def test_peers_with_a_token_or_mutual_tls(certs: Path) -> None:
    (certs / "token").write_text(" shared-token \n")
    assert (
        check(_args("--peers", "127.0.0.1:18092", "--peer-token-file", str(certs / "token")))[2]
        == "shared-token"
    )  # type: ignore[arg-type]
    tls, _, token = check(
        _args(  # type: ignore[arg-type]
            "--peers", "127.0.0.1:18092", "--tls-cert", str(certs / "picker.pem"), "--tls-key",
            str(certs / "picker.key"), "--tls-client-ca", str(certs / "ca.pem"),
        )
    )  # fmt: skip
    assert tls is not None and tls.client_ca is not None and token is None


def test_the_index_process_cpu_defaults_to_its_limit_and_refuses_none_or_past_64_cores(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from controlplane import limits

    assert _args().kv_index_cpu == limits.KV_INDEX_CPU  # type: ignore[attr-defined]
    assert _args("--kv-index-cpu", "1.5").kv_index_cpu == 1.5  # type: ignore[attr-defined]
    for bad in ("0", "-1", "65", "nan", "lots"):
        with pytest.raises(SystemExit):
            _args("--kv-index-cpu", bad)
        assert "--kv-index-cpu" in capsys.readouterr().err
