"""A self-signed CA and a serving certificate for the admission webhook (pure, in memory).

kube-apiserver only calls webhooks over TLS and checks the serving certificate against the
caBundle of the webhook configuration, so vramsched makes both: an EC P-256 CA and a leaf for
the Service's DNS names (and any IPs given). PEM bytes in, PEM bytes out; storing them is the
caller's business (extender.webhook.bootstrap keeps them in a Secret).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["ServingCert", "make_serving_cert", "cert_covers", "cert_expires", "service_hosts"]

CA_DAYS = 3650
LEAF_DAYS = 825
#: Renew when fewer days than this are left.
RENEW_DAYS = 30


@dataclass(frozen=True, slots=True)
class ServingCert:
    cert_pem: bytes
    key_pem: bytes
    ca_pem: bytes


def service_hosts(service: str) -> list[str]:
    """The DNS names a Service `name.namespace` answers to inside the cluster."""
    name, _, namespace = service.partition(".")
    if not name or not namespace:
        raise ValueError(f"service {service!r} is not name.namespace")
    base = f"{name}.{namespace}"
    return [name, base, f"{base}.svc", f"{base}.svc.cluster.local"]


def _san(hosts: Iterable[str]) -> x509.SubjectAlternativeName:
    names: list[x509.GeneralName] = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_serving_cert(hosts: list[str], *, now: dt.datetime | None = None) -> ServingCert:
    """A new CA and a serving certificate for `hosts` (DNS names or IP addresses)."""
    if not hosts:
        raise ValueError("a serving certificate needs at least one host")
    now = now or dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "vramsched-webhook-ca")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=LEAF_DAYS))
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return ServingCert(
        leaf.public_bytes(pem),
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        ca.public_bytes(pem),
    )


def cert_expires(cert_pem: bytes) -> dt.datetime:
    return x509.load_pem_x509_certificate(cert_pem).not_valid_after_utc


def cert_covers(cert_pem: bytes, hosts: Iterable[str], *, now: dt.datetime | None = None) -> bool:
    """Whether a stored certificate still serves `hosts` for at least RENEW_DAYS."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return False
    have = {str(n) for n in san.get_values_for_type(x509.DNSName)}
    have |= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    wanted = {str(ipaddress.ip_address(h)) if _is_ip(h) else h for h in hosts}
    now = now or dt.datetime.now(dt.UTC)
    return wanted <= have and cert.not_valid_after_utc - now > dt.timedelta(days=RENEW_DAYS)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
