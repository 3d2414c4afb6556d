"""Generated stub namespace mirroring protos/ (scripts/gen_protos.py)."""
