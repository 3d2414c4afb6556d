"""splitserve workers: the engine, local batch policies, KV transfer and the Worker service."""
