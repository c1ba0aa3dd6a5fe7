"""In-process pipeline tests: fast, no processes, no sockets (``-m "not integration"`` runs them)."""
