"""Load generator: pure core (arrivals, traces, workloads, sessions, metrics) plus runner, targets, reports and CLI."""
