"""The simulator clock: workload schema and sampling, trace replay, the event-driven
simulator."""
