"""`python -m services.global_scheduler`: run the scheduler with config from SPLITSERVE_* env vars."""

from services.global_scheduler.server import main
from splitserve.config import SchedulerConfig, load_config

main(load_config(SchedulerConfig))
