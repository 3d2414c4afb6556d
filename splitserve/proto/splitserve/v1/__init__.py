"""Generated protobuf and gRPC stubs of package splitserve.v1 (gen_protos.py)."""
