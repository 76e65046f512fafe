"""Test helper: a local Ray + Serve instance on 127.0.0.1 with a free HTTP port.

What every HTTP test module needs (``address="local"``, loopback only, a tenants file in a temp
dir, Serve and Ray shut down afterwards), in one place: the module fixtures only say what they
deploy.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import yaml

from cluster.loopback import start_serve


@contextlib.contextmanager
def local_serve(tenants: dict, tmp_dir: Path):
    """Yield ``(base_url, tenants_path, serve)``: Serve on a free loopback port, ``tenants``
    written to ``tmp_dir/tenants.yaml``. Starts Ray only when it is not running (and then
    shuts it down again)."""
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    import ray
    from ray import serve

    started = not ray.is_initialized()
    if started:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    port = start_serve()
    path = Path(tmp_dir) / "tenants.yaml"
    path.write_text(yaml.safe_dump(tenants))
    try:
        yield f"http://127.0.0.1:{port}", path, serve
    finally:
        serve.shutdown()
        if started:
            ray.shutdown()
