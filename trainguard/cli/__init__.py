"""The ``trainguard`` / ``kubectl-trainguard`` command line: a thin client of the HTTP API."""
