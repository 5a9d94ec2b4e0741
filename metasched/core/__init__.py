"""The scheduling core shared by the simulator and the live dispatcher: actions, resource
pools, the cluster state, the ``Scheduler`` interface, the guard, the decision step and
the sandbox queue both clocks call, the observation encoder and the run metrics."""
