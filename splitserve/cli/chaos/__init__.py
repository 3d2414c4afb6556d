"""`splitserve chaos`: faults injected into a running local cluster under known traffic (run.py
tells the whole story). One module a concern: options, the cluster's processes, the traffic, the
faults, the run, the report, and the command."""

from splitserve.cli.chaos.command import chaos_command
from splitserve.cli.chaos.faults import FaultRecord, plan_faults
from splitserve.cli.chaos.options import FAULT_KINDS, ChaosError, ChaosOptions
from splitserve.cli.chaos.processes import ServiceProcess, find_service_processes, parse_service_cmdline
from splitserve.cli.chaos.report import ChaosReport, render_report
from splitserve.cli.chaos.run import run_chaos
from splitserve.cli.chaos.traffic import ChaosCase, RequestOutcome

__all__ = ["ChaosError", "ChaosOptions", "ChaosCase", "ChaosReport", "FaultRecord", "RequestOutcome",
           "ServiceProcess", "find_service_processes", "parse_service_cmdline", "plan_faults", "run_chaos",
           "render_report", "chaos_command", "FAULT_KINDS"]
