"""Live cluster state in Redis: the store (`store`), its connection and retry policy
(`connection`) and the Lua scripts that update it atomically (`scripts`). The records kept
there are plain data in `splitserve.core.records`, so the pure core can read them."""
