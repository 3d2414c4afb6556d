"""Generated stubs of protos/splitserve/v1: `from splitserve.proto import worker_pb2`."""

from splitserve.proto.splitserve.v1 import (
    coordinator_pb2,
    coordinator_pb2_grpc,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    types_pb2,
    types_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

__all__ = [
    "coordinator_pb2",
    "coordinator_pb2_grpc",
    "gateway_pb2",
    "gateway_pb2_grpc",
    "scheduler_pb2",
    "scheduler_pb2_grpc",
    "types_pb2",
    "types_pb2_grpc",
    "worker_pb2",
    "worker_pb2_grpc",
]
