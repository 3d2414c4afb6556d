"""GPU step timing: the `PerfModel` contract and its tables (`model`, `tables`), model and
GPU specs (`presets`), the backends that fill it — NVIDIA aiconfigurator's measured database
(`aiconfigurator`) and the fitted roofline (`roofline`) — and loading a profiled model
(`store`). Pure: no torch, gRPC or Redis (docs/perf_model.md)."""
