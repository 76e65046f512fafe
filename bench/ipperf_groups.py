"""The group of each prompt inference-perf's ``shared_prefix`` generator will send, in order.

Run with inference-perf's own interpreter (its venv, Python >= 3.12), not kvmesh's:
``<venv>/bin/python bench/ipperf_groups.py <inference-perf.yaml>`` prints a JSON list, entry i =
the group of the i-th request (its generator builds every prompt from the config's seed, then
walks one seeded shuffle of them in order; ``bench.ipperf.group_order`` calls this). Nothing is
sent anywhere.
"""

import json
import sys

from inference_perf.config import read_config
from inference_perf.datagen import SharedPrefixDataGenerator
from inference_perf.utils import CustomTokenizer

if __name__ == "__main__":
    cfg = read_config(sys.argv[1])
    gen = SharedPrefixDataGenerator(cfg.api, cfg.data, CustomTokenizer(cfg.tokenizer))
    print(json.dumps([int(g) for g in gen.prompt_groups]))
