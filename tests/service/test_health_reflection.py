"""Standard gRPC health checking and server reflection, as stock tools use them."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvstore.client import ClientError, ClientOptions, KVStoreClient
from kvstore.rpc.pb import SERVICE

SERVING = health_pb2.HealthCheckResponse.SERVING


def test_health_says_serving_for_the_server_and_the_store_then_goes_away(served):
    with grpc.insecure_channel(served.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE):
            resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert resp.status == SERVING, name
        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND

        with KVStoreClient(served.address) as c:
            assert c.ping()

        served.server.stop()

        with pytest.raises(grpc.RpcError) as err:
            health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=2)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    with KVStoreClient(served.address, ClientOptions(timeout_s=1, retries=0)) as c:
        with pytest.raises(ClientError) as err:
            c.ping()
        assert err.value.code == grpc.StatusCode.UNAVAILABLE


def _ask(stub, **request) -> reflection_pb2.ServerReflectionResponse:
    (resp,) = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(**request)]), timeout=5
    )
    return resp


def test_reflection_lists_the_services_and_describes_kvstore(served):
    with grpc.insecure_channel(served.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)

        listed = {s.name for s in _ask(stub, list_services="").list_services_response.service}
        assert {SERVICE, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= (
            listed
        )

        resp = _ask(stub, file_containing_symbol=SERVICE)
        files = [
            descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in resp.file_descriptor_response.file_descriptor_proto
        ]
        kvstore_file = next(f for f in files if f.package == "kvstore.v1")
        (service,) = kvstore_file.service
        assert service.name == "KVStore"
        assert {m.name for m in service.method} == {
            "Lookup",
            "Get",
            "GetShm",
            "Put",
            "ReserveShm",
            "CommitShm",
            "Release",
            "Delete",
            "Stats",
            "Explain",
            "Routes",
        }
        methods = {m.name: m for m in service.method}
        assert methods["Get"].server_streaming and methods["Put"].client_streaming

        missing = _ask(stub, file_containing_symbol="kvstore.v1.NoSuchThing")
        assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
