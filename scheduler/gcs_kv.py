"""Reading the farm service's entry in a Ray cluster's internal KV over gRPC alone, without Ray.

A client that names only the cluster (`farm submit --address`) finds the service's store in the
cluster's KV (SERVICE_STORE_KEY, left there by scheduler/ray_service.py). Ray's own GCS client
lives in `ray._raylet`, and importing it imports all of Ray: 0.3-0.4 s, a third of a hit through
the service. The two calls needed here (InternalKVGet and GetClusterId) are plain unary gRPC
calls to the GCS, so this module makes them with grpcio and protobuf (both Ray's dependencies)
in about 50 ms, with the auth token found where Ray finds it.

The request and reply messages are declared here from Ray's `gcs_service.proto` (field numbers are
the wire format, which Ray keeps stable across versions; tests/test_service.py checks them against
Ray's generated classes). The same GetClusterId call tells at once whether the cluster refuses
this process's token (`refused`), where Ray's own client retries for about 20 s before saying
so. Whatever this path cannot read (a refused token, a GCS that does not
answer at that address, an unexpected reply) raises Unread, and the caller falls back to Ray's
client (scheduler/ray_session.service_store), which knows loopback clusters and explains failures.
"""
from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

NAMESPACE = "farm"  # the farm's Ray namespace: its service's actor, and its keys in Ray's internal KV
SERVICE_STORE_KEY = b"farm-scheduler/store"
TIMEOUT_S = 3.0
_KV_GET = "/ray.rpc.InternalKVGcsService/InternalKVGet"
_CLUSTER_ID = "/ray.rpc.NodeInfoGcsService/GetClusterId"
_NOT_FOUND = 17  # ray::StatusCode::NotFound, what the GCS answers for an absent key
_HOST_PORT = re.compile(r"[\w.-]+:\d+|\[[0-9a-fA-F:.]+\]:\d+")


class Unread(Exception):
    """This path could not read the cluster's KV; Ray's own client should try (and say why)."""


def default_token_path() -> Path:
    return Path.home() / ".ray" / "auth_token"


def _auth() -> list[tuple[str, str]] | None:
    """The call metadata that carries the token Ray would send (none without one)."""
    token = ray_token()
    return [("authorization", f"Bearer {token}")] if token else None


def ray_token() -> str | None:
    """The auth token Ray would send when joining by address: with RAY_AUTH_MODE=token only (Ray
    2.60 sends none otherwise, even where ~/.ray/auth_token exists), looked for where Ray looks
    (RAY_AUTH_TOKEN, then the file RAY_AUTH_TOKEN_PATH names, then ~/.ray/auth_token)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return None
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or default_token_path())
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


@cache
def _messages() -> dict:
    """The four messages of Ray's gcs_service.proto this module sends and reads."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    proto = descriptor_pb2.FileDescriptorProto(name="farm_gcs_kv.proto", package="farm.gcs_kv", syntax="proto3")
    field = descriptor_pb2.FieldDescriptorProto
    shapes = {"GcsStatus": [("code", 1, field.TYPE_INT32, None), ("message", 2, field.TYPE_STRING, None)],
              "InternalKVGetRequest": [("key", 1, field.TYPE_BYTES, None), ("namespace", 2, field.TYPE_BYTES, None)],
              "InternalKVGetReply": [("status", 1, field.TYPE_MESSAGE, ".farm.gcs_kv.GcsStatus"),
                                     ("value", 2, field.TYPE_BYTES, None)],
              "GetClusterIdReply": [("status", 1, field.TYPE_MESSAGE, ".farm.gcs_kv.GcsStatus"),
                                    ("cluster_id", 2, field.TYPE_BYTES, None)]}
    for name, fields in shapes.items():
        message = proto.message_type.add(name=name)
        for fname, number, ftype, type_name in fields:
            message.field.add(name=fname, number=number, type=ftype, label=field.LABEL_OPTIONAL,
                              **({"type_name": type_name} if type_name else {}))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"farm.gcs_kv.{name}"))
            for name in shapes}


def refused(address: str, timeout: float = TIMEOUT_S) -> str | None:
    """Why the GCS at `address` (HOST:PORT) refuses this process, its token missing or wrong, from
    one GetClusterId call (milliseconds, where Ray's own client retries for about 20 s before it
    gives up); None when it answers, or when this path cannot tell."""
    if not _HOST_PORT.fullmatch(address):
        return None
    import grpc

    with grpc.insecure_channel(address) as channel:
        ids = channel.unary_unary(_CLUSTER_ID, request_serializer=lambda _: b"",
                                  response_deserializer=_messages()["GetClusterIdReply"].FromString)
        try:
            ids(None, timeout=timeout, metadata=_auth())
        except grpc.RpcError as e:
            return (e.details() or "unauthenticated") if e.code() == grpc.StatusCode.UNAUTHENTICATED else None
    return None


def read_service_store(address: str, timeout: float = TIMEOUT_S) -> tuple[str, str] | None:
    """The service's store URI and the cluster's id (hex) as the GCS at `address` (HOST:PORT)
    keeps them; None when the GCS answers that no service left its store there; Unread otherwise."""
    if not _HOST_PORT.fullmatch(address):
        raise Unread(f"{address}: not HOST:PORT")
    import grpc

    kinds = _messages()
    metadata = _auth()
    with grpc.insecure_channel(address) as channel:
        try:
            kv = channel.unary_unary(_KV_GET, request_serializer=lambda m: m.SerializeToString(),
                                     response_deserializer=kinds["InternalKVGetReply"].FromString)
            got = kv(kinds["InternalKVGetRequest"](key=SERVICE_STORE_KEY, namespace=NAMESPACE.encode()),
                     timeout=timeout, metadata=metadata)
            if got.status.code == _NOT_FOUND:
                return None
            ids = channel.unary_unary(_CLUSTER_ID, request_serializer=lambda _: b"",
                                      response_deserializer=kinds["GetClusterIdReply"].FromString)
            cluster = ids(None, timeout=timeout, metadata=metadata)
        except grpc.RpcError as e:  # refused, unreachable, or a reply that does not parse
            raise Unread(f"{address}: {e.code().name}: {e.details()}") from None
    if got.status.code or cluster.status.code or not got.value or not cluster.cluster_id:
        raise Unread(f"{address}: the GCS answered status {got.status.code or cluster.status.code}")
    try:
        return got.value.decode(), cluster.cluster_id.hex()
    except UnicodeDecodeError:
        raise Unread(f"{address}: the store URI in the KV is not text") from None
