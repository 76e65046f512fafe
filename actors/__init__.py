"""Ray actors of kvmesh: workers (one engine each), and later the index and router actors."""
