"""A local certificate authority for `kvlane up --secure --tls` and the tests.

One CA, one server certificate for the loopback names (nats-server and
redis-server share it) and one client certificate (for servers that verify
clients). ECDSA P-256: generated in milliseconds. Keys are written mode 0600.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK = ("localhost", "127.0.0.1", "::1")


@dataclass(frozen=True)
class Certs:
    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path


def write_private(path: Path, data: bytes) -> None:
    """Write `data` readable by its owner only (created 0600, never wider even for a moment)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as file:
        file.write(data)
    os.chmod(path, 0o600)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "kvlane"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def _issue(
    subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name, issuer_key: ec.EllipticCurvePrivateKey, days: int,
    ca: bool = False, hosts: tuple[str, ...] = (), usage: tuple[x509.ObjectIdentifier, ...] = (),
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False),
            critical=True,
        )
    if hosts:
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    if usage:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usage)), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def make_certs(directory: Path, hosts: tuple[str, ...] = LOOPBACK, days: int = 365) -> Certs:
    """A new CA and the server and client certificates it signs, written under `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = _issue("kvlane local CA", ca_key, _name("kvlane local CA"), ca_key, days, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = _issue(hosts[0], server_key, ca_cert.subject, ca_key, days, hosts=hosts,
                         usage=(ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH))
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = _issue("kvlane client", client_key, ca_cert.subject, ca_key, days, usage=(ExtendedKeyUsageOID.CLIENT_AUTH,))
    certs = Certs(directory / "ca.pem", directory / "server.pem", directory / "server-key.pem",
                  directory / "client.pem", directory / "client-key.pem")
    pem = serialization.Encoding.PEM
    certs.ca.write_bytes(ca_cert.public_bytes(pem))
    certs.cert.write_bytes(server_cert.public_bytes(pem))
    certs.client_cert.write_bytes(client_cert.public_bytes(pem))
    write_private(certs.key, _key_pem(server_key))
    write_private(certs.client_key, _key_pem(client_key))
    # The CA's key is not kept: nothing more is signed with it.
    return certs
