"""Errors raised for user input (configs, traces, overrides)."""


class ConfigError(ValueError):
    """A user-supplied setting is invalid.

    The message is one line that names the offending field, e.g.
    ``workload.tasks[0].actions[1].duration_s.median: must be > 0 (got -1)``.
    Command-line apps print it without a traceback and exit with status 2.
    """

    def __init__(self, field: str, problem: str) -> None:
        # One line, whatever the names in it contain.
        self.field = str(field).replace("\r", "\\r").replace("\n", "\\n")
        self.problem = str(problem).replace("\r", "\\r").replace("\n", "\\n")
        super().__init__(f"{self.field}: {self.problem}")

    def __reduce__(self):
        # Rebuilt from both parts, so it crosses process boundaries (evaluation workers).
        return type(self), (self.field, self.problem)
