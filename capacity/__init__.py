"""Capacity planning tools outside the serving path: the memory plan (`shuttle plan`), the step-cost calibration,
the discrete-event simulator that drives the real Scheduler, and workloads for it."""
