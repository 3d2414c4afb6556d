"""Ingress: the gRPC Gateway service and the OpenAI-compatible HTTP API."""
