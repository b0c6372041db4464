"""Program identities by archive digest: what a sandbox computed from a .pt2's bytes (the
digests a key hashes), kept so a later job with the same archive answers its hits without
loading the graph at all.

    programs/<archive sha256>/<variant>.json   {"identity": {...}, "built_with": ...}

The variant names everything besides the bytes that decides the identity (the farm's key
version, torch, the weights mode, a specialization). Documents are signed like manifests
(storage/signing.py); one that fails the check is ignored and the graph is loaded again.
"""
from __future__ import annotations

from typing import Any

from storage.signing import UntrustedDocument
from storage.store import Store, blob_path


def _path(archive_digest: str, variant: str) -> str:
    blob_path(archive_digest)  # validates the digest
    if not variant.isalnum():
        raise ValueError(f"not a variant: {variant!r}")
    return f"programs/{archive_digest}/{variant}.json"


def get_identity(store: Store, archive_digest: str, variant: str) -> dict[str, Any] | None:
    try:
        return store.get_document(_path(archive_digest, variant))
    except UntrustedDocument:
        return None


def put_identity(store: Store, archive_digest: str, variant: str, doc: dict[str, Any]) -> None:
    store.put_document(_path(archive_digest, variant), doc, if_absent=True)
