"""Moving KV blocks between workers: NIXL (UCX) or gRPC byte streams."""
