"""A store in an S3 bucket (AWS or any S3-compatible server such as SeaweedFS or MinIO).

Endpoint, region and credentials come from boto3's standard chain (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ~/.aws/config, instance roles…); nothing here reads or logs secrets.
S3 objects appear only when a PUT or a multipart upload completes, so readers never see
half an object; the manifest's conditional write is `If-None-Match: *`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import boto3
import botocore.exceptions
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from storage.backend import StoreError

# Multipart above 64 MiB, 4 parts in flight: artifacts with packaged weights get large.
TRANSFER = TransferConfig(multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=4)
_NOT_FOUND = {"404", "NoSuchKey", "NotFound"}
_CONDITION_FAILED = {"412", "PreconditionFailed", "409", "ConditionalRequestConflict"}


def _code(e: botocore.exceptions.ClientError) -> str:
    return str(e.response.get("Error", {}).get("Code", ""))


class S3Backend:
    def __init__(self, bucket: str, prefix: str = "", client=None):
        if not bucket:
            raise ValueError("an s3:// store URI needs a bucket: s3://BUCKET[/PREFIX]")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.uri = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self._client = client or boto3.session.Session().client(
            "s3", config=Config(retries={"max_attempts": 5, "mode": "standard"})
        )

    def _key(self, path: str) -> str:
        return f"{self.prefix}/{path}" if self.prefix else path

    def _fail(self, what: str, path: str, e: Exception) -> StoreError:
        hint = ""
        if isinstance(e, botocore.exceptions.NoCredentialsError):
            hint = " (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or an AWS profile)"
        elif isinstance(e, botocore.exceptions.EndpointConnectionError):
            hint = " (is the endpoint in AWS_ENDPOINT_URL reachable?)"
        return StoreError(f"{what} {self.uri}/{path} failed: {e}{hint}")

    def read(self, path: str) -> bytes | None:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=self._key(path))["Body"].read()
        except botocore.exceptions.ClientError as e:
            if _code(e) in _NOT_FOUND:
                return None
            raise self._fail("read", path, e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail("read", path, e) from e

    def write(self, path: str, data: bytes, *, if_absent: bool = False) -> bool:
        extra = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(path), Body=data, **extra)
            return True
        except botocore.exceptions.ClientError as e:
            if if_absent and _code(e) in _CONDITION_FAILED:
                return False
            raise self._fail("write", path, e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail("write", path, e) from e

    def upload_file(self, path: str, src: Path) -> None:
        try:
            self._client.upload_file(str(src), self.bucket, self._key(path), Config=TRANSFER)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError, boto3.exceptions.S3UploadFailedError) as e:
            raise self._fail("upload", path, e) from e

    def download_file(self, path: str, dest: Path) -> bool:
        try:
            self._client.download_file(self.bucket, self._key(path), str(dest), Config=TRANSFER)
            return True
        except botocore.exceptions.ClientError as e:
            if _code(e) in _NOT_FOUND:
                return False
            raise self._fail("download", path, e) from e
        except botocore.exceptions.BotoCoreError as e:
            raise self._fail("download", path, e) from e

    def size(self, path: str) -> int | None:
        try:
            return int(self._client.head_object(Bucket=self.bucket, Key=self._key(path))["ContentLength"])
        except botocore.exceptions.ClientError as e:
            if _code(e) in _NOT_FOUND:
                return None
            raise self._fail("stat", path, e) from e

    def exists(self, path: str) -> bool:
        return self.size(path) is not None

    def list(self, prefix: str) -> Iterator[str]:
        strip = len(self.prefix) + 1 if self.prefix else 0
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix)
            )
            for page in pages:
                for obj in page.get("Contents", []):
                    yield obj["Key"][strip:]
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._fail("list", prefix, e) from e

    def delete(self, path: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(path))
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as e:
            raise self._fail("delete", path, e) from e
