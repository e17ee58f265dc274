"""The e2e control plane's certificates, made with openssl: one CA signs everything.

Why one CA: kube-apiserver trusts it for client certificates (``--client-ca-file``), a kubelet
trusts it for the apiserver's client certificate (``authentication.x509.clientCAFile``), and
every client verifies serving certificates with it. Files are created once and reused (a
ControlPlane restarted in the same workdir keeps its identity).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from pathlib import Path


class PkiError(RuntimeError):
    """openssl failed; the message carries its stderr."""


class Pki:
    """A folder of PEM files: ``ca.crt``/``ca.key``, ``sa.key``/``sa.pub`` and issued pairs."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ca_cert = folder / "ca.crt"
        self.ca_key = folder / "ca.key"
        self.sa_key = folder / "sa.key"
        self.sa_pub = folder / "sa.pub"

    def ensure_base(self) -> None:
        """CA, apiserver serving pair, service-account key pair (kept if already there)."""
        if self.sa_pub.exists():
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        self._openssl(
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            self.ca_key.name,
            "-out",
            self.ca_cert.name,
            "-days",
            "3650",
            "-subj",
            "/CN=vramsched-e2e-ca",
        )
        self.serving_pair(
            "apiserver",
            "kube-apiserver",
            ips=("127.0.0.1", "10.0.0.1"),
            dns=("localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"),
        )
        self._openssl("genrsa", "-out", self.sa_key.name, "2048")
        self._openssl("rsa", "-in", self.sa_key.name, "-pubout", "-out", self.sa_pub.name)

    def serving_pair(
        self, name: str, common_name: str, *, ips: Sequence[str] = (), dns: Sequence[str] = ()
    ) -> tuple[Path, Path]:
        """``<name>.crt``/``<name>.key`` for a TLS server reached at these IPs and DNS names."""
        san = ",".join([f"IP:{ip}" for ip in ips] + [f"DNS:{d}" for d in dns])
        return self._issue(name, f"/CN={common_name}", "serverAuth", san)

    def client_pair(self, name: str, user: str, groups: Sequence[str] = ()) -> tuple[Path, Path]:
        """``<name>.crt``/``<name>.key`` authenticating as ``user`` (CN) in ``groups`` (O)."""
        subject = "".join(f"/O={g}" for g in groups) + f"/CN={user}"
        return self._issue(name, subject, "clientAuth", "")

    def _issue(self, name: str, subject: str, usage: str, san: str) -> tuple[Path, Path]:
        cert, key = self.folder / f"{name}.crt", self.folder / f"{name}.key"
        if cert.exists() and key.exists():
            return cert, key
        ext = self.folder / f"{name}.ext"
        lines = [f"extendedKeyUsage={usage}", "keyUsage=digitalSignature,keyEncipherment"]
        if san:
            lines.insert(0, f"subjectAltName={san}")
        ext.write_text("\n".join(lines) + "\n")
        csr = f"{name}.csr"
        self._openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key.name,
            "-out",
            csr,
            "-subj",
            subject,
        )
        self._openssl(
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            self.ca_cert.name,
            "-CAkey",
            self.ca_key.name,
            "-CAcreateserial",
            "-out",
            cert.name,
            "-days",
            "3650",
            "-extfile",
            ext.name,
        )
        key.chmod(0o600)
        return cert, key

    def _openssl(self, *args: str) -> None:
        proc = subprocess.run(
            ["openssl", *args], cwd=self.folder, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise PkiError(f"openssl {' '.join(args)} failed:\n{proc.stderr}")
