"""The store layout of DESIGN.md on top of any backend.

    blobs/sha256/<aa>/<digest>    content-addressed bytes, checked against their digest on every read
    units/<key>.json              manifests, published last and only once (conditional write)
    jobs/<job-id>/…               job spec and results table
    leases/<key>/<generation>     who is compiling a key right now (see leases.py)
    pins/<name>.json              units kept whatever their age (see pins.py)

Every Store counts the blob bytes it moves (`transfer`), so a unit can report what it cost.

Last use: an object's mtime. A unit's manifest and its blobs are touched when the unit is used
(a hit, a fetch, a warm start), at most once per refresh age, so a collector (storage/gc.py) or
a bucket lifecycle rule that expires by age expires by last use. A blob a publisher relies on
without uploading it (it was there already) is touched too, before the manifest names it: the
collector re-reads a blob's age just before deleting it, and leaves one that is young.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from storage.backend import Backend, StoreError
from storage.signing import Trust, UntrustedDocument
from storage.unit_refs import PublishJournal

_CHUNK = 1 << 20
log = logging.getLogger(__name__)
DEFAULT_REFRESH_AGE_S = 86400.0  # a day: a hot unit costs its store one touch a day, not one per hit


# How long a blob this process just wrote or touched counts as young without asking the store:
# far below any sane grace period (a day by default; storage/gc.py), which covers the rest.
RECENT_S = 2.0


def refresh_age_s() -> float:
    """How old a unit's last-use mark may get before a use renews it (FARM_REFRESH_AGE_S)."""
    given = os.environ.get("FARM_REFRESH_AGE_S", "")
    try:
        age = float(given) if given else DEFAULT_REFRESH_AGE_S
    except ValueError:
        age = -1.0
    if not age >= 0:
        raise ValueError(f"FARM_REFRESH_AGE_S={given!r} is not a number of seconds >= 0")
    return age


class CorruptBlob(StoreError):
    """A blob whose bytes do not hash to its name: never hand those bytes to anyone."""


class UnknownKey(ValueError):
    """No manifest, or more than one, answers to the key (or prefix) asked for; the message says
    what to give instead."""


MIN_KEY_PREFIX = 6


@dataclass
class Transfer:
    """Blob bytes moved: to the store, from it, and served by a local tier instead."""

    uploaded: int = 0
    downloaded: int = 0
    cached: int = 0

    def __sub__(self, other: "Transfer") -> "Transfer":
        return Transfer(self.uploaded - other.uploaded, self.downloaded - other.downloaded, self.cached - other.cached)

    def copy(self) -> "Transfer":
        return Transfer(self.uploaded, self.downloaded, self.cached)


@dataclass(frozen=True)
class BlobRef:
    digest: str
    size: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "BlobRef":
        return cls(str(d["digest"]), int(d["size"]))


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def blob_path(digest: str) -> str:
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"not a sha256 hex digest: {digest!r}")
    return f"blobs/sha256/{digest[:2]}/{digest}"


def manifest_path(key: str) -> str:
    if not key or "/" in key or key.startswith("."):
        raise ValueError(f"not a unit key: {key!r}")
    return f"units/{key}.json"


class Store:
    def __init__(self, backend: Backend, trust: Trust | None = None):
        self.backend = backend
        self.transfer = Transfer()
        self.trust = trust if trust is not None else Trust.from_env()  # signs and checks documents
        self.clock = time.time  # the last-use rule's clock (a fake one in tests)
        self.refresh_age_s = refresh_age_s()
        self._used: dict[str, float] = {}  # key -> when this process last looked at its last-use mark
        self._made_young: dict[str, float] = {}  # digest -> when (monotonic) this process last uploaded or touched it
        # what this process publishes, told to the collector (storage/unit_refs.py); only where
        # the listing's ETag is the content's MD5, which is how the collector checks an entry
        self.journal = PublishJournal(backend) if getattr(backend, "tags_content", False) else None

    @property
    def uri(self) -> str:
        return self.backend.uri

    # blobs -------------------------------------------------------------------------
    def put_bytes(self, data: bytes) -> BlobRef:
        ref = BlobRef(hashlib.sha256(data).hexdigest(), len(data))
        if not self._kept(ref):
            self.backend.write(blob_path(ref.digest), data)
            self.transfer.uploaded += ref.size
            self._mark_young(ref.digest)
        return ref

    def put_file(self, src: Path) -> BlobRef:
        src = Path(src)
        ref = BlobRef(sha256_file(src), src.stat().st_size)
        if not self._kept(ref):
            self.backend.upload_file(blob_path(ref.digest), src)
            self.transfer.uploaded += ref.size
            self._mark_young(ref.digest)
        return ref

    def _kept(self, ref: BlobRef) -> bool:
        """Whether the blob is in the store already, made young so that a collector leaves it to
        the caller, who is about to rely on it (race: a collector that read its age before this
        touch and deletes after it; storage/gc.py re-reads mtimes shard by shard to keep that
        window short, and a manifest published into it is incomplete, so readers call it a miss)."""
        if not (self.has_blob(ref) and self.backend.touch(blob_path(ref.digest))):
            return False
        self._mark_young(ref.digest)
        return True

    def _mark_young(self, digest: str) -> None:
        now = time.monotonic()
        if len(self._made_young) >= 4096:  # a long-lived worker: forget what is no longer recent
            self._made_young = {d: t for d, t in self._made_young.items() if now - t < RECENT_S}
        self._made_young[digest] = now

    def _young(self, ref: BlobRef) -> bool:
        """`_kept`, but a blob this process uploaded or touched within the last RECENT_S counts as
        young without asking: a publish right after its uploads does not copy each artifact onto
        itself again (S3's touch)."""
        return time.monotonic() - self._made_young.get(ref.digest, float("-inf")) < RECENT_S or self._kept(ref)

    def has_blob(self, ref: BlobRef) -> bool:
        return self.backend.size(blob_path(ref.digest)) == ref.size

    def get_bytes(self, digest: str) -> bytes:
        data = self.backend.read(blob_path(digest))
        if data is None:
            raise StoreError(f"blob {digest} is missing from {self.uri}")
        self.transfer.downloaded += len(data)
        if hashlib.sha256(data).hexdigest() != digest:
            raise CorruptBlob(f"blob {digest} in {self.uri} does not match its digest; refusing it")
        return data

    def fetch(self, digest: str, dest: Path) -> Path:
        """Download a blob to dest, verified; dest appears only if the digest matches."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
        os.close(fd)
        tmp = Path(tmp_name)
        try:
            if not self.backend.download_file(blob_path(digest), tmp):
                raise StoreError(f"blob {digest} is missing from {self.uri}")
            self.transfer.downloaded += tmp.stat().st_size
            if sha256_file(tmp) != digest:
                raise CorruptBlob(f"blob {digest} in {self.uri} does not match its digest; refusing it")
            os.replace(tmp, dest)
        finally:
            tmp.unlink(missing_ok=True)
        return dest

    # signed documents (storage/signing.py) -----------------------------------------
    def put_document(self, path: str, doc: dict[str, Any], if_absent: bool = False) -> bool:
        """Write a JSON document, signed when this process holds FARM_SIGNING_KEY."""
        return self.backend.write(path, self._sealed(path, doc), if_absent=if_absent)

    def _sealed(self, path: str, doc: dict[str, Any]) -> bytes:
        return json.dumps(self.trust.seal(path, doc), indent=1, sort_keys=True).encode()

    def get_document(self, path: str) -> dict[str, Any] | None:
        """A JSON document, or None; raises UntrustedDocument if signatures are required and its
        signature is missing or wrong."""
        data = self.backend.read(path)
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise UntrustedDocument(f"{path} in {self.uri} is not JSON ({e}); refusing it") from e
        return self.trust.open(path, doc)

    def read_unchecked(self, path: str) -> dict[str, Any] | None:
        """A JSON document's content without the signature check, or None if it is missing or not
        a JSON object: only for keeping more (the collector's marks), never for serving."""
        data = self.backend.read(path)
        try:
            doc = json.loads(data) if data is not None else None
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    # manifests ---------------------------------------------------------------------
    def publish_manifest(self, key: str, manifest: dict[str, Any]) -> bool:
        """Publish once. Every blob the manifest names must already be in the store (each is made
        young first: see `_kept`).

        Returns False if a complete manifest for key already exists (another writer won). One whose
        blobs are gone is worth nothing: it is replaced."""
        self._check_blobs(key, manifest)
        data = self._sealed(manifest_path(key), manifest)
        if self._write_manifest(key, data, manifest, if_absent=True):
            return True
        try:
            existing = self.get_manifest(key)
        except UntrustedDocument:
            return False  # not ours to judge or overwrite: the signature check will keep refusing it
        if existing is None or not self.missing_blobs(existing):
            return False
        log.warning("%s: the published manifest names blobs that are gone (%s); replacing it", key,
                    ", ".join(self.missing_blobs(existing)))
        self._write_manifest(key, data, manifest)
        return True

    def _write_manifest(self, key: str, data: bytes, manifest: dict[str, Any], if_absent: bool = False) -> bool:
        """Write a manifest's sealed bytes; once written, note it in the journal for the collector."""
        written = self.backend.write(manifest_path(key), data, if_absent=if_absent)
        if written and self.journal is not None:
            self.journal.note(key, data, manifest)
        return written

    def flush_journal(self) -> None:
        """Write out what this process published for the collector now (it is also written every
        few hundred publishes and half a minute after a publish)."""
        if self.journal is not None:
            self.journal.flush()

    def _check_blobs(self, key: str, manifest: dict[str, Any]) -> None:
        for role, ref in manifest.get("blobs", {}).items():
            if ref is not None and not self._young(BlobRef.from_dict(ref)):
                raise StoreError(f"refusing to publish {key}: its {role} blob {ref['digest']} is not in {self.uri}")

    def missing_blobs(self, manifest: dict[str, Any]) -> list[str]:
        """The roles (artifact, log, …) of the manifest's blobs that are not in the store."""
        return [role for role, ref in manifest.get("blobs", {}).items()
                if ref is not None and not self.has_blob(BlobRef.from_dict(ref))]

    def complete_manifest(self, key: str) -> tuple[dict[str, Any] | None, str | None]:
        """The manifest of key if every blob it names is in the store; else None, and why (a blob
        was deleted: by a collector, a lifecycle rule or a person). A reader never serves such a unit."""
        manifest = self.get_manifest(key)
        missing = self.missing_blobs(manifest) if manifest is not None else []
        if missing:
            return None, f"its manifest named {' and '.join(missing)} blob(s) that are gone from {self.uri}"
        return manifest, None

    def note_use(self, key: str, manifest: dict[str, Any]) -> bool:
        """Renew the unit's last-use mark (its manifest's and blobs' mtime) if it is older than the
        refresh age; True if it did. A process asks the store at most once per refresh age per key,
        and a use writes only when the mark is old, so hits do not turn into writes. Best effort:
        a store that refuses only loses the mark, never the read."""
        now = self.clock()
        if now - self._used.get(key, float("-inf")) < self.refresh_age_s:
            return False
        self._used[key] = now
        try:
            info = self.backend.stat(manifest_path(key))
            if info is None or now - info.mtime < self.refresh_age_s:
                return False
            self.backend.touch(manifest_path(key))
            for ref in manifest.get("blobs", {}).values():
                if ref is not None:
                    self.backend.touch(blob_path(BlobRef.from_dict(ref).digest))
        except StoreError as e:
            log.warning("%s: last use not recorded in %s (%s)", key, self.uri, e)
            return False
        return True

    def replace_manifest(self, key: str, manifest: dict[str, Any]) -> None:
        """Overwrite a manifest: only for a decision the user asked to revisit (autotune retune).
        Its blobs must be in the store, as for publishing."""
        self._check_blobs(key, manifest)
        self._write_manifest(key, self._sealed(manifest_path(key), manifest), manifest)

    def get_manifest(self, key: str) -> dict[str, Any] | None:
        """The manifest of key, or None; raises UntrustedDocument when it fails the signature check."""
        return self.get_document(manifest_path(key))

    def manifest_keys(self) -> Iterator[str]:
        for path in self.backend.list("units/"):
            if path.endswith(".json"):
                yield path[len("units/") : -len(".json")]

    def resolve_key(self, text: str) -> str:
        """A full key, or a unique prefix of one as results tables print it (`8e0ed2c3fbec854b…`)."""
        text = text.strip().rstrip("…").lower()
        if not text or text.strip("0123456789abcdef"):
            raise UnknownKey(f"{text!r} is not a key: keys are hex digits (sha256), as `farm results JOB` prints them")
        if len(text) == 64:
            return text
        if len(text) < MIN_KEY_PREFIX:
            raise UnknownKey(f"{text!r} is too short to name a key; give at least {MIN_KEY_PREFIX} characters")
        found = [k for k in self.backend.list(f"units/{text}") if k.endswith(".json")]
        if len(found) != 1:
            what = "no key" if not found else f"{len(found)} keys"
            raise UnknownKey(f"{what} in {self.uri} start with {text!r}; "
                             + ("`farm results JOB` lists a job's keys" if not found else "give more characters"))
        return found[0][len("units/") : -len(".json")]

    # jobs --------------------------------------------------------------------------
    def put_job_file(self, job_id: str, name: str, data: bytes, if_absent: bool = False) -> str | None:
        """Write a job's file; with if_absent, only where there is none (None if there was)."""
        path = f"jobs/{job_id}/{name}"
        written = self.backend.write(path, data, if_absent=if_absent)
        return path if written or not if_absent else None

    def get_job_file(self, job_id: str, name: str) -> bytes | None:
        return self.backend.read(f"jobs/{job_id}/{name}")

    def job_ids(self) -> list[str]:
        return sorted({p.split("/")[1] for p in self.backend.list("jobs/") if p.count("/") >= 2})
