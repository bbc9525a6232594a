"""Offline EPLB tools behind `moeserve eplb` (cli.py): synthetic workloads, analysis, simulation, planning."""
