"""The scheduling core shared by the simulator and the live dispatcher: actions, resource
pools, the cluster state, the ``Scheduler`` interface, the guard, the observation encoder
and the run metrics."""
