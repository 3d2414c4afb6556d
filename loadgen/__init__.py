"""Load generator: arrival processes, traces, workloads, sessions and metrics (pure core)."""
