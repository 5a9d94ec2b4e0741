"""Calibration: fitting a workload profile to a recorded trace (``metasched-calibrate``)."""
