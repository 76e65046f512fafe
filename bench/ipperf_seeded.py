"""inference-perf itself, with its Poisson arrival times drawn from a seeded generator.

Run with inference-perf's own interpreter: ``<venv>/bin/python bench/ipperf_seeded.py
--config_file <yaml>`` (``bench.ipperf.run`` with ``arrival_seed``). inference-perf 0.7.0 seeds
its data generator and workers from ``load.base_seed`` but draws each Poisson stage's arrivals
from an unseeded ``np.random.default_rng()`` (``loadgen/load_timer.py``), so two configurations
driven with the same config got different arrival times: in session 18's default run the 2 req/s
stage offered 2.26 req/s to kvmesh, 1.78 to affinity and 1.86 to pow2, and a side-by-side
comparison at one nominal rate compared different loads. Here timer k of the run (stages are
timed in order) draws from ``default_rng([KVMESH_IPERF_ARRIVAL_SEED, k])``: every configuration
gets the same arrival times, stage by stage. Nothing else changes; the rest is ``main_cli``.
"""

import itertools
import os
import sys

import numpy as np
from inference_perf import main_cli
from inference_perf.loadgen import load_timer

SEED = int(os.environ["KVMESH_IPERF_ARRIVAL_SEED"])
_timers = itertools.count()
_init = load_timer.PoissonLoadTimer.__init__


def _seeded_init(self, rate: float, duration: float) -> None:
    _init(self, rate, duration)
    self._rand = np.random.default_rng([SEED, next(_timers)])


load_timer.PoissonLoadTimer.__init__ = _seeded_init

if __name__ == "__main__":
    sys.argv[0] = "inference-perf"
    sys.exit(main_cli())
