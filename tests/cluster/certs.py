"""Owns the test PKI of the cluster harness: a throwaway CA and loopback server certificates.

Made with the `openssl` command line tool, so no Python crypto package is needed. Every
component of the harness (kube-apiserver, the kubelet simulator's exec server, the fault proxy)
gets a certificate for 127.0.0.1/localhost signed by one CA, so clients verify TLS normally.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CertPair:
    cert: Path
    key: Path


def _openssl(*args: str) -> None:
    result = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"openssl {' '.join(args[:2])} failed: {result.stderr.strip()}")


def make_ca(directory: Path) -> CertPair:
    """Create a CA key and self-signed certificate in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    pair = CertPair(directory / "ca.crt", directory / "ca.key")
    _openssl("genrsa", "-out", str(pair.key), "2048")
    _openssl(
        "req", "-x509", "-new", "-key", str(pair.key), "-sha256", "-days", "3650",
        "-subj", "/CN=leasekeeper-test-ca", "-out", str(pair.cert),
    )
    return pair


def make_server_cert(ca: CertPair, directory: Path, name: str) -> CertPair:
    """Create a server certificate for 127.0.0.1, ::1 and localhost signed by ``ca``."""
    directory.mkdir(parents=True, exist_ok=True)
    pair = CertPair(directory / f"{name}.crt", directory / f"{name}.key")
    csr = directory / f"{name}.csr"
    ext = directory / f"{name}.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "subjectAltName=IP:127.0.0.1,IP:::1,DNS:localhost,DNS:kubernetes,"
        "DNS:kubernetes.default,DNS:kubernetes.default.svc,IP:10.0.0.1\n"
    )
    _openssl("genrsa", "-out", str(pair.key), "2048")
    _openssl("req", "-new", "-key", str(pair.key), "-subj", f"/CN={name}", "-out", str(csr))
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", str(ca.cert), "-CAkey", str(ca.key),
        "-CAcreateserial", "-days", "3650", "-sha256", "-extfile", str(ext), "-out", str(pair.cert),
    )
    return pair


def make_rsa_key(path: Path) -> Path:
    """Create an RSA private key (used to sign and verify ServiceAccount tokens)."""
    _openssl("genrsa", "-out", str(path), "2048")
    return path
