"""Runs inside an actor through ``handle.__ray_call__``: kept free of heavy imports so the actor's
process unpickles it quickly (a lambda defined in a module that imports Serve would make the
actor import Serve first)."""

import os


def pid_and_node(_self) -> tuple[int, str]:
    import ray

    return os.getpid(), ray.get_runtime_context().get_node_id()
