"""``ray`` CLI whose node start waits up to ``KVMESH_RAY_START_WAIT_S`` (240 s) for the raylet to
register, instead of Ray's hard-coded 30 s (``ray._private.node.Node``), which a machine at load
30-40 misses. Used by ``bench.servelab.lab_with_retries`` as the lab's ``ray`` binary."""

import os
import sys
import time

import ray._private.services as services

_get_node = services.get_node
_WAIT_S = float(os.environ.get("KVMESH_RAY_START_WAIT_S", "240"))


def _patient_get_node(gcs_address, node_id, *args, **kwargs):
    start = time.monotonic()
    while True:
        try:
            return _get_node(gcs_address, node_id, *args, **kwargs)
        except RuntimeError:
            if time.monotonic() - start > _WAIT_S:
                raise
            time.sleep(0.5)


services.get_node = _patient_get_node

if __name__ == "__main__":
    from ray.scripts.scripts import main

    sys.exit(main())
