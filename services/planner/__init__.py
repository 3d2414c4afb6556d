"""Planner: the AMPD deployment planner and the discrete-event simulator it evaluates plans with.

Simulator entry points: `services.planner.simulator.Simulator` (API) and
`services.planner.cli.simulate_app` (`splitserve simulate`).
"""
