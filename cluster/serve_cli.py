"""``serve`` (Ray Serve's CLI) that always stops on SIGINT: what ``make serve`` runs.

``serve run`` stops on KeyboardInterrupt (it then deletes the app and shuts Ray down). Python
raises KeyboardInterrupt only if SIGINT was not ignored when the process started, and a
non-interactive shell starts every background job with SIGINT ignored (``make serve &`` in a
script, a test harness): there ``kill -INT`` (or a Ctrl-C reaching it) did nothing and only
SIGTERM ended it. This restores Python's SIGINT handler first, so SIGINT means "stop" however the
process was started; everything else is Ray's CLI unchanged.

  python -m cluster.serve_cli run cluster/serve.yaml      (same arguments as ``serve``)
"""

from __future__ import annotations

import signal
import sys


def main() -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from ray.serve.scripts import cli

    sys.argv[0] = "serve"
    return cli()


if __name__ == "__main__":
    sys.exit(main())
