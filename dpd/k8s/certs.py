"""The webhook's certificate when none is mounted: self-signed, made at the operator's start.

The API server calls the validating webhook over HTTPS and trusts the CA bundle kopf writes
into the ValidatingWebhookConfiguration. A certificate from cert-manager (``DPD_WEBHOOK_CERT_DIR``)
is preferred; without one, the operator makes its own here — kopf's own fallback needs the
``certbuilder`` package, which the image does not carry, so the install would fail at start.
The certificate names the webhook Service's DNS name, is its own CA (the bundle kopf publishes
is this certificate), and lives for ``days``; a restart makes a new one and kopf re-publishes it.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def self_signed_certificate(host: str, directory: Path, days: int = 365) -> tuple[Path, Path]:
    """Write ``tls.crt`` and ``tls.key`` (0600) for ``host`` into ``directory``; returns their paths."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])])
    now = datetime.datetime.now(datetime.UTC)
    names = [x509.DNSName(host)]
    if "." in host:  # the Service's short names too: NAME.NAMESPACE.svc -> NAME.NAMESPACE, NAME
        parts = host.split(".")
        names += [x509.DNSName(".".join(parts[:2])), x509.DNSName(parts[0])]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False, key_agreement=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    cert_path, key_path = directory / "tls.crt", directory / "tls.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    return cert_path, key_path
