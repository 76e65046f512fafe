"""lm-evaluation-harness against the served default model, scored like lm-eval's own ``hf`` backend.

The test writes two small tasks (local JSON data + task YAML, loaded with ``--include_path``, no
download): a multiple-choice task (loglikelihoods: ``echo`` + ``logprobs`` + ``max_tokens: 1``
over batched token-id prompts) and a generation task (``generate_until``: batched token-id
prompts with ``stop`` and ``seed``). ``lm_eval --model local-completions`` runs as a real CLI, with
its default tokenized requests and, since kvmesh serves ``/tokenizer_info`` + ``/tokenize``, its
remote tokenizer. Its per-document loglikelihoods equal the ``hf`` backend's to 1e-3 and its
scores exactly; a second run gives the same scores with its generation prompts served from the
prefix cache (scoring requests recompute their prompts: prompt logprobs need every position's
logits, which a cache hit does not have).
"""

import glob
import json
import os
import subprocess
import sys

import pytest
from test_http import client, server  # noqa: F401 - the served app fixture

pytestmark = [pytest.mark.ray, pytest.mark.model]

TASKS = ("kvmesh_mc", "kvmesh_gen")
MC = [
    ("What colour is the sky on a clear day?", ["blue", "green", "red"], 0),
    ("How many legs does a spider have?", ["six", "eight", "four"], 1),
    ("Which animal says moo?", ["a cat", "a dog", "a cow"], 2),
    ("What is the opposite of hot?", ["cold", "loud", "tall"], 0),
    ("Which of these is a fruit?", ["a carrot", "an apple", "a potato"], 1),
    ("What do bees make?", ["milk", "silk", "honey"], 2),
    ("Which planet do we live on?", ["Earth", "Mars", "Venus"], 0),
    ("What is frozen water called?", ["steam", "ice", "sand"], 1),
    ("How many days are in a week?", ["five", "ten", "seven"], 2),
]
GEN = [("2 + 2", "4"), ("3 + 5", "8"), ("10 - 3", "7"), ("6 + 1", "7"), ("9 - 4", "5"), ("1 + 1", "2"),
       ("4 + 4", "8"), ("7 - 2", "5")]

MC_YAML = """task: kvmesh_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_YAML = """task: kvmesh_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: 1 + 2 = ?\\nA: 3\\nQ: 5 - 1 = ?\\nA: 4\\nQ: {{{{q}}}} = ?\\nA:"
doc_to_target: " {{{{a}}}}"
generation_kwargs:
  until: ["\\n", "Q:"]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: true
"""


def _write_tasks(d):
    mc, gen = d / "mc.jsonl", d / "gen.jsonl"
    mc.write_text("".join(json.dumps({"question": q, "choices": c, "label": lab}) + "\n" for q, c, lab in MC))
    gen.write_text("".join(json.dumps({"q": q, "a": a}) + "\n" for q, a in GEN))
    (d / "kvmesh_mc.yaml").write_text(MC_YAML.format(data=mc))
    (d / "kvmesh_gen.yaml").write_text(GEN_YAML.format(data=gen))


def _env(tmp):
    env = dict(os.environ, OPENAI_API_KEY="sk-acme", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp / "hf-datasets"), TOKENIZERS_PARALLELISM="false")
    return env


def _lm_eval_cli(base, tasks_dir, out, env) -> tuple[dict, dict]:
    """Run the lm_eval CLI against the server on both tasks; (results, samples) per task."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions",
           "--model_args", f"model=default,base_url={base}/v1/completions,auth_token=sk-acme,max_retries=1,timeout=300",
           "--tasks", ",".join(TASKS), "--include_path", str(tasks_dir), "--batch_size", "4",
           "--output_path", str(out), "--log_samples"]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    assert "Using remote tokenizer" in p.stderr + p.stdout  # kvmesh's /tokenizer_info + /tokenize
    [res] = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    samples = {}
    for task in TASKS:
        [f] = glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True)
        samples[task] = [json.loads(line) for line in open(f)]
    return json.load(open(res))["results"], samples


def _cached_tokens(base) -> float:
    import httpx

    text = httpx.get(f"{base}/metrics", timeout=60).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("kvmesh_cached_tokens_total{"))


def _lls(samples) -> dict[int, list[float]]:
    """doc_id -> the loglikelihood of every choice."""
    return {s["doc_id"]: [float(r[0]) for r in s["filtered_resps"]] for s in samples}


def _gens(samples) -> dict[int, str]:
    return {s["doc_id"]: s["filtered_resps"][0] for s in samples}


@pytest.fixture(scope="module")
def smol_base(server):
    from cluster.app import build_app

    server["serve"].run(build_app({"model": "default", "tenants": server["tenants"], "kv_cache_bytes": 64 << 20,
                                   "worker_num_cpus": 0}), name="smol-lm", route_prefix="/smol-lm")
    yield f"{server['base']}/smol-lm"
    server["serve"].delete("smol-lm")


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm-eval")
    (d / "tasks").mkdir()
    _write_tasks(d / "tasks")
    return d


@pytest.fixture(scope="module")
def hf_ref(tasks):
    """lm-eval's own hf backend on the same weights (fp32, cpu): results and samples per task."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from engine.model_loader import resolve_model_dir

    env = _env(tasks)
    saved = {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE")}
    os.environ.update({k: env[k] for k in saved})
    try:
        _, model_dir = resolve_model_dir("default")
        out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={model_dir},dtype=float32,device=cpu",
                                      tasks=list(TASKS), batch_size=1, log_samples=True,
                                      task_manager=TaskManager(include_path=str(tasks / "tasks")))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


def test_lm_eval_local_completions_equals_hf_backend_cold_and_warm(smol_base, tasks, hf_ref):
    ref_lls, ref_gens = _lls(hf_ref["samples"]["kvmesh_mc"]), _gens(hf_ref["samples"]["kvmesh_gen"])
    assert len(ref_lls) == len(MC) and len(ref_gens) == len(GEN)
    env, worst = _env(tasks), 0.0
    for run in ("cold", "warm"):
        before = _cached_tokens(smol_base)
        results, samples = _lm_eval_cli(smol_base, tasks / "tasks", tasks / f"out-{run}", env)
        if run == "warm":  # the generation prompts (few-shot prefix and all) come from the prefix cache
            assert _cached_tokens(smol_base) - before >= 16 * len(GEN)
        lls = _lls(samples["kvmesh_mc"])
        assert lls.keys() == ref_lls.keys()
        for doc in ref_lls:
            assert lls[doc] == pytest.approx(ref_lls[doc], abs=1e-3), (run, doc)
            worst = max(worst, *(abs(a - b) for a, b in zip(lls[doc], ref_lls[doc])))
        assert results["kvmesh_mc"]["acc,none"] == hf_ref["results"]["kvmesh_mc"]["acc,none"], run
        assert _gens(samples["kvmesh_gen"]) == ref_gens, run
        assert results["kvmesh_gen"]["exact_match,none"] == hf_ref["results"]["kvmesh_gen"]["exact_match,none"], run
    print(f"lm-eval kvmesh_mc acc {results['kvmesh_mc']['acc,none']:.4f} and kvmesh_gen exact_match "
          f"{results['kvmesh_gen']['exact_match,none']:.4f}, both equal to the hf backend; "
          f"max |loglikelihood - hf| {worst:.2e} over {len(MC)} docs x choices, cold and warm")
