"""Evaluating schedulers in simulation: parallel runs over seeds, statistics, capacity
planning, reports."""
