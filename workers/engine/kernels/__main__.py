"""`python -m workers.engine.kernels`: build the CPU kernels ahead of the first worker (`make setup`)."""

import logging

from workers.engine.kernels import load

logging.basicConfig(level=logging.INFO)
print("paged decode attention kernel:", "built" if load() is not None else "unavailable (the torch path serves)")
