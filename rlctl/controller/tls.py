"""TLS for the agent link: a per-job self-signed certificate that every agent pins.

Role: where agents reach the controller over a shared network (ssh and slurm backends), the link
is encrypted and the agents know they talk to this job's controller. The controller makes one
key and one self-signed certificate per job, in the job directory (key 0600, made with
``O_EXCL``), and reuses them when it resumes, so agents keep working across a controller
restart. The certificate (public) travels to each agent inside its 0600 config; the agent trusts
that certificate and nothing else, and checks the peer's certificate byte for byte (pinning), so
no CA and no host name are involved. The job secret's challenge-response still authenticates
each agent to the controller.
"""

from __future__ import annotations

import datetime
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

CERT_FILE_NAME = "agent-tls.crt"
KEY_FILE_NAME = "agent-tls.key"
VALID_DAYS = 3650
TLS_HANDSHAKE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class JobCertificate:
    cert_path: Path
    key_path: Path
    cert_pem: str


def tls_enabled(setting: str, crosses_network: bool) -> bool:
    """``[cluster] agent_tls``: ``auto`` is on wherever agents reach the controller across a
    network (the ssh and slurm backends), off for the local backend's processes."""
    if setting == "auto":
        return crosses_network
    return setting == "on"


def ensure_job_certificate(job_dir: Path, job_id: str) -> JobCertificate:
    """The job's certificate and key, made on first use and reused after (a resumed controller)."""
    cert_path, key_path = job_dir / CERT_FILE_NAME, job_dir / KEY_FILE_NAME
    if not (cert_path.exists() and key_path.exists()):
        for half_made in (cert_path, key_path):  # a controller that died between the two writes
            half_made.unlink(missing_ok=True)
        _make_certificate(cert_path, key_path, job_id)
    return JobCertificate(cert_path, key_path, cert_path.read_text())


def server_context(certificate: JobCertificate) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(certificate.cert_path, certificate.key_path)
    return context


def _make_certificate(cert_path: Path, key_path: Path, job_id: str) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"rlctl controller {job_id}"[:64])])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=VALID_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_bytes = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key_bytes)
    cert_path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
