"""TLS certificates for tests, made with the ``openssl`` command: a CA of the test's own and a
certificate it signed for 127.0.0.1, or a self-signed certificate for 127.0.0.1.

Standard library only: the repository's tests (``.venv``) and the open client's own tests
(``client/tests``, run in ``.venv-client`` where nothing of Relay is installed) both import it.
"""

from __future__ import annotations

import ssl
import subprocess
from pathlib import Path


def _openssl(folder: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)


def _server_context(cert: Path, key: Path) -> ssl.SSLContext:
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    return server


def make_certificates(folder: Path, ca_name: str = "relay test CA") -> tuple[Path, ssl.SSLContext]:
    """A CA of our own and a certificate it signed for 127.0.0.1: (the CA's file, the server's context)."""
    _openssl(folder, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
             "-days", "1", "-subj", f"/CN={ca_name}")  # fmt: skip
    _openssl(folder, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
             "-subj", "/CN=127.0.0.1")  # fmt: skip
    (folder / "san.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    _openssl(folder, "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "server.pem", "-days", "1", "-extfile", "san.cnf")  # fmt: skip
    return folder / "ca.pem", _server_context(folder / "server.pem", folder / "server.key")


def make_self_signed(folder: Path) -> ssl.SSLContext:
    """A server's context whose certificate for 127.0.0.1 is signed by its own key (no CA at all)."""
    _openssl(folder, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "self.key", "-out", "self.pem",
             "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1")  # fmt: skip
    return _server_context(folder / "self.pem", folder / "self.key")
