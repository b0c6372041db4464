"""A store in an S3 bucket (AWS or any S3-compatible server such as SeaweedFS or MinIO).

Endpoint, region and credentials come from boto3's standard chain (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ~/.aws/config, instance roles…); nothing here reads or logs secrets.
S3 objects appear only when a PUT or a multipart upload completes, so readers never see
half an object; the manifest's conditional write is `If-None-Match: *`.
"""
from __future__ import annotations

import logging
import random
import secrets
import time
from pathlib import Path
from typing import Any, Callable, Iterator, TypeVar

import boto3
import botocore.exceptions
import urllib3.exceptions
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from storage.backend import ObjectInfo, StoreError, UnsafeStore

log = logging.getLogger(__name__)

# Multipart above 64 MiB, 4 parts in flight: artifacts with packaged weights get large.
TRANSFER = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=4)
T = TypeVar("T")
_RAISE = object()  # sentinel: let the error through as StoreError
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_CONDITION_FAILED = {"412", "PreconditionFailed", "409", "ConditionalRequestConflict"}
_BUSY = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout", "Throttling", "ThrottlingException"}
# Botocore retries a request that fails before its response starts; these attempts also cover a
# response body that breaks off mid-read (which botocore, or urllib3 beneath it, raises as is).
ATTEMPTS = 4
BACKOFF_S = 0.25
BOTO_ATTEMPTS = 5  # botocore's own, per request
DELETE_BATCH = 1000  # S3's DeleteObjects takes at most this many keys a call


def _code(e: botocore.exceptions.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


def _transient(e: Exception) -> bool:
    """An error that another attempt may not meet: the connection, a timeout, a busy server."""
    if isinstance(e, botocore.exceptions.ClientError):
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return _code(e) in _BUSY or status >= 500
    return isinstance(e, (botocore.exceptions.HTTPClientError, botocore.exceptions.ConnectionError,
                          botocore.exceptions.IncompleteReadError, urllib3.exceptions.HTTPError,
                          boto3.exceptions.S3UploadFailedError))


class S3Backend:
    tags_content = True  # a single PUT's ETag is its content's MD5 (storage/unit_refs.py relies on it)

    def __init__(self, bucket: str, prefix: str = "", client=None):
        if not bucket:
            raise ValueError("an s3:// store URI needs a bucket: s3://BUCKET[/PREFIX]")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self._client = client or boto3.session.Session().client(
            "s3", config=Config(retries={"max_attempts": BOTO_ATTEMPTS, "mode": "standard"})
        )
        self.retried = 0  # calls this backend attempted again after a transient error
        self._conditional: bool | None = None  # does the server honour If-None-Match? (probed once)

    def _key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    def _fail(self, what: str, path: str, e: Exception) -> StoreError:
        hint = ""
        if isinstance(e, botocore.exceptions.NoCredentialsError):
            hint = " (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an AWS profile)"
        elif isinstance(e, botocore.exceptions.EndpointConnectionError):
            hint = " (is the endpoint in AWS_ENDPOINT_URL reachable?)"
        return StoreError(f"{what} {self.uri}/{path} failed: {e}{hint}")

    _ERRORS = (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, boto3.exceptions.S3UploadFailedError,
               urllib3.exceptions.HTTPError)

    def _call(self, what: str, path: str, fn: Callable[[], T], *, missing: Any = _RAISE,
              conflict: Any = _RAISE) -> T:
        """Run one boto3 call, again after a transient error (ATTEMPTS in all); 'not found' and
        'condition failed' become values, the rest StoreError. A conditional write attempted
        again may meet its own first attempt, which succeeded unseen: callers that care read
        back what they wrote (storage/leases.py does)."""
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return fn()
            except self._ERRORS as e:
                code = _code(e) if isinstance(e, botocore.exceptions.ClientError) else ""
                if code in _NOT_FOUND and missing is not _RAISE:
                    return missing
                if code in _CONDITION_FAILED and conflict is not _RAISE:
                    return conflict
                if attempt == ATTEMPTS or not _transient(e):
                    raise self._fail(what, path, e) from e
                self.retried += 1
                log.info("%s %s/%s: attempt %d failed (%s); trying again", what, self.uri, path, attempt, type(e).__name__)
                time.sleep(BACKOFF_S * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
        raise AssertionError("unreachable")

    def read(self, path: str) -> bytes | None:
        return self._call("read", path, lambda: self._client.get_object(
            Bucket=self.bucket, Key=self._key(path))["Body"].read(), missing=None)

    def read_tail(self, path: str, n: int) -> bytes | None:
        return self._call("read", path, lambda: self._client.get_object(  # (a suffix range: all of a shorter one)
            Bucket=self.bucket, Key=self._key(path), Range=f"bytes=-{n}")["Body"].read(), missing=None)

    def write(self, path: str, data: bytes, *, if_absent: bool = False) -> bool:
        if if_absent:
            self._require_conditional_writes()
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        return self._call("write", path, lambda: self._client.put_object(
            Bucket=self.bucket, Key=self._key(path), Body=data, **extra) and True,
            conflict=False if if_absent else _RAISE)

    def _require_conditional_writes(self) -> None:
        """Leases and manifests are published with `If-None-Match: *`; a server that ignores it
        would let two workers both win. Probe once (write a scratch object twice); against such
        a server the farm refuses to publish rather than race."""
        if self._conditional is None:
            probe = f"_probe/conditional-write-{secrets.token_hex(8)}"
            put = lambda: self._client.put_object(Bucket=self.bucket, Key=self._key(probe), Body=b"1", IfNoneMatch="*")
            self._call("write", probe, put)
            self._conditional = self._call("write", probe, lambda: put() and False, conflict=True)
            self._call("delete", probe, lambda: self._client.delete_object(Bucket=self.bucket, Key=self._key(probe)))
        if not self._conditional:
            raise UnsafeStore(f"the S3 server behind {self.uri} ignores conditional writes (If-None-Match: *), so "
                             f"leases and manifests could be published twice; the farm refuses to publish to it. "
                             f"Use a server that honours them (AWS S3, SeaweedFS, MinIO, moto)")

    def upload_file(self, path: str, src: Path) -> None:
        self._call("upload", path, lambda: self._client.upload_file(str(src), self.bucket, self._key(path), Config=TRANSFER))

    def download_file(self, path: str, dest: Path) -> bool:
        return self._call("download", path, lambda: self._client.download_file(
            self.bucket, self._key(path), str(dest), Config=TRANSFER) or True, missing=False)

    def size(self, path: str) -> int | None:
        return self._call("stat", path, lambda: int(self._client.head_object(
            Bucket=self.bucket, Key=self._key(path))["ContentLength"]), missing=None)

    def exists(self, path: str) -> bool:
        return self.size(path) is not None

    def list(self, prefix: str) -> Iterator[str]:
        return (info.path for info in self.list_info(prefix))

    def list_info(self, prefix: str) -> Iterator[ObjectInfo]:
        strip = len(self.prefix) + 1 if self.prefix else 0

        def every_page() -> list[ObjectInfo]:  # listed whole, so an attempt again starts from the first page
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
            return [ObjectInfo(obj["Key"][strip:], int(obj["Size"]), obj["LastModified"].timestamp(), obj.get("ETag"))
                    for page in pages for obj in page.get("Contents", [])]

        yield from self._call("list", prefix, every_page)

    def stat(self, path: str) -> ObjectInfo | None:
        def head() -> ObjectInfo:
            got = self._client.head_object(Bucket=self.bucket, Key=self._key(path))
            return ObjectInfo(path, int(got["ContentLength"]), got["LastModified"].timestamp(), got.get("ETag"))

        return self._call("stat", path, head, missing=None)

    def touch(self, path: str) -> bool:
        """A copy of the object onto itself: S3 has no other way to renew LastModified, which is
        also what a bucket lifecycle rule expires by. The managed copy does it in parts above 5 GiB."""
        source = {"Bucket": self.bucket, "Key": self._key(path)}
        extra = {"MetadataDirective": "REPLACE", "Metadata": {"farm-used": str(int(time.time()))}}
        return self._call("touch", path, lambda: self._client.copy(source, self.bucket, self._key(path), ExtraArgs=extra,
                                                                   Config=TRANSFER) or True, missing=False)

    def delete(self, path: str) -> None:
        self._call("delete", path, lambda: self._client.delete_object(Bucket=self.bucket, Key=self._key(path)))

    def delete_many(self, paths: list[str]) -> None:
        for start in range(0, len(paths), DELETE_BATCH):
            batch = paths[start:start + DELETE_BATCH]
            objects = {"Objects": [{"Key": self._key(p)} for p in batch], "Quiet": True}
            got = self._call("delete", batch[0], lambda: self._client.delete_objects(Bucket=self.bucket, Delete=objects))
            failed = [e for e in got.get("Errors", []) if e.get("Code") not in _NOT_FOUND]
            if failed:
                raise StoreError(f"delete in {self.uri} failed for {len(failed)} of {len(batch)} objects, "
                                 f"e.g. {failed[0].get('Key')}: {failed[0].get('Code')} {failed[0].get('Message')}")
