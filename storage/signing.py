"""Signed documents: manifests, tuning records and shared autotune timings steer what every
machine builds and loads, so a store that anyone could write must not be trusted by content.

    FARM_SIGNING_KEY   an Ed25519 private key (PEM text, or the path of a PEM file): documents
                       this process publishes are signed; it also trusts its own public key
    FARM_VERIFY_KEY    an Ed25519 public key (PEM text or path): documents read must carry a
                       valid signature by it (or by the signing key above)

With neither set, documents are written and read unsigned, as before. The signature covers
the document's store path and its canonical JSON, so a signed manifest cannot be copied to
another key, and editing any field (say, the artifact's digest) breaks it. Artifacts
themselves are covered through the digests the manifest names (every blob read is checked
against its sha256).

    farm keygen DIR    writes signing.pem (keep it on workers only) and verify.pem
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from storage.backend import StoreError

SIGNATURE = "signature"


class UntrustedDocument(StoreError):
    """A document is unsigned or wrongly signed where signatures are required."""


def _pem(value: str, what: str) -> bytes:
    value = value.strip()
    if value.startswith("-----BEGIN"):
        return value.encode()
    try:
        return Path(value).expanduser().read_bytes()
    except OSError as e:
        raise ValueError(f"{what}: neither PEM text nor a readable PEM file ({e.strerror})") from None


def _public_bytes(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id(key: Ed25519PublicKey) -> str:
    return hashlib.sha256(_public_bytes(key)).hexdigest()[:16]


def _canonical(path: str, doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != SIGNATURE}
    return path.encode() + b"\n" + json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Trust:
    signing_key: Ed25519PrivateKey | None = None
    verify_keys: tuple[Ed25519PublicKey, ...] = ()

    @classmethod
    def from_env(cls) -> "Trust":
        signing, verify = os.environ.get("FARM_SIGNING_KEY"), os.environ.get("FARM_VERIFY_KEY")
        private = None
        keys: list[Ed25519PublicKey] = []
        if signing:
            loaded = serialization.load_pem_private_key(_pem(signing, "FARM_SIGNING_KEY"), password=None)
            if not isinstance(loaded, Ed25519PrivateKey):
                raise ValueError("FARM_SIGNING_KEY is not an Ed25519 private key; make one with `farm keygen DIR`")
            private = loaded
            keys.append(private.public_key())
        if verify:
            public = serialization.load_pem_public_key(_pem(verify, "FARM_VERIFY_KEY"))
            if not isinstance(public, Ed25519PublicKey):
                raise ValueError("FARM_VERIFY_KEY is not an Ed25519 public key; use the verify.pem of `farm keygen`")
            keys.append(public)
        return cls(private, tuple(keys))

    @property
    def required(self) -> bool:
        return bool(self.verify_keys)

    def seal(self, path: str, doc: dict[str, Any]) -> dict[str, Any]:
        """The document as it is written: signed when this process holds a signing key."""
        doc = {k: v for k, v in doc.items() if k != SIGNATURE}
        if self.signing_key is None:
            return doc
        value = self.signing_key.sign(_canonical(path, doc))
        doc[SIGNATURE] = {"alg": "ed25519", "key_id": key_id(self.signing_key.public_key()),
                          "value": base64.b64encode(value).decode()}
        return doc

    def open(self, path: str, doc: Any) -> dict[str, Any]:
        """The document as read, after checking its signature when signatures are required."""
        if not isinstance(doc, dict):
            raise UntrustedDocument(f"{path} is not a JSON object")
        if not self.required:
            return doc
        problem = self.problem(path, doc)
        if problem:
            raise UntrustedDocument(f"{path}: {problem}; refusing it (it may have been written without "
                                    f"FARM_SIGNING_KEY, or tampered with)")
        return doc

    def problem(self, path: str, doc: dict[str, Any]) -> str | None:
        sig = doc.get(SIGNATURE)
        if not isinstance(sig, dict):
            return "unsigned"
        if sig.get("alg") != "ed25519":
            return f"signed with an unknown algorithm {sig.get('alg')!r}"
        try:
            value = base64.b64decode(str(sig.get("value")), validate=True)
        except ValueError:
            return "its signature is not base64"
        for key in self.verify_keys:
            try:
                key.verify(value, _canonical(path, doc))
                return None
            except InvalidSignature:
                continue
        return f"its signature (key {sig.get('key_id')!r}) does not match its content under any trusted key"


def describe(doc: dict[str, Any]) -> str:
    sig = doc.get(SIGNATURE)
    return f"signed (ed25519, key {sig.get('key_id')})" if isinstance(sig, dict) else "unsigned"


def keygen(folder: Path) -> tuple[Path, Path]:
    """Write a new key pair: signing.pem (private, mode 600) and verify.pem (public)."""
    folder.mkdir(parents=True, exist_ok=True)
    key = Ed25519PrivateKey.generate()
    private, public = folder / "signing.pem", folder / "verify.pem"
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                      serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public
