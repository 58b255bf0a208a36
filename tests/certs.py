"""Test certificates from the `openssl` command, made fresh for each run: a CA, and
certificates it signed, each good for TLS server and client use (a picker serves Envoy and
reads its peers with the same one)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certs(directory: Path, names: tuple[str, ...] = ("server", "client"), ca: str = "ca") -> Path:
    """`<ca>.pem/.key`, then `<name>.pem/.key` for each name, signed by it, with the name as CN
    and DNS subjectAltName, and 127.0.0.1 and localhost too. Skips the test without openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is not installed")
    directory.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN=test-{ca}",
             "-keyout", f"{ca}.key", "-out", f"{ca}.pem", cwd=directory)  # fmt: skip
    for name in names:
        (directory / f"{name}.ext").write_text(
            f"subjectAltName=DNS:{name},IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n"
        )
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=directory)  # fmt: skip
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
                 "-CAcreateserial", "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem",
                 cwd=directory)  # fmt: skip
    return directory
