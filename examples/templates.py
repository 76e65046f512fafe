"""Approximate reuse of a template's KV across prompts that differ in parameter values.

    serve run cluster/serve.yaml            # or: make serve   (in another terminal)
    .venv/bin/python examples/templates.py [--base-url http://127.0.0.1:8000] [--api-key sk-acme-demo]

Registers a template for the tenant (``POST /v1/templates``), then sends instances of it with
``kvmesh: {reuse: "approximate", template, params}``. The tenant's quality gate (on by default,
``remap:`` in the tenants file) serves the first instances exactly while it measures what
approximate KV would have changed; once enough checks agree, responses report
``approx_cached_tokens`` > 0. Each line shows the reuse and the gate's state for the template.
Approximate reuse pays only where template text follows a parameter (here the guidelines): a
request with fewer than 16 reusable tokens beyond its exact prefix hit simply runs exactly.

What to expect on the default 135M model (measured): the checks disagree on a few of these
prompts, the gate escalates the recompute share (0.3 -> 0.5 -> 0.7) and then closes the template:
approximate KV would have changed those answers, so it is not served. That is the measurement
doing its job; a tenant with ``remap: {gate: false}`` gets approximate KV at once, at the quality
cost ``bench/remap.py`` reports.
"""

import argparse
import json
import urllib.request

from openai import OpenAI

TEMPLATE = ("Translate the text below into French.\n\nText: {text}\n\nGuidelines:\n"
            "1. Keep the meaning of the original text exactly; do not add or remove information.\n"
            "2. Keep names of people and places unchanged.\n"
            "3. Use a neutral, polite register suitable for a general audience.\n"
            "4. Keep numbers, dates and times in their original form.\n"
            "5. Answer with the French translation only, on a single line.\n\nFrench translation:")
TEXTS = ["The weather is nice today.", "My brother lives near the river.", "Please close the door.",
         "We go to the market on Saturday.", "The children play in the park.", "I would like a coffee.",
         "She reads a book every evening.", "The museum opens at nine.", "Our neighbours have a dog.",
         "He forgot his keys at the office.", "The soup needs more salt.", "They travelled to Spain.",
         "The train leaves at noon.", "My sister plays the piano.", "The shop is closed on Sunday.",
         "We painted the kitchen blue.", "The cat sleeps on the sofa.", "I lost my umbrella again.",
         "The garden is full of roses.", "Dinner is ready at seven.", "The bus was late this morning.",
         "He writes letters to his aunt.", "The lake is cold in April.", "She bought a red bicycle."]


def call(base: str, key: str, path: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return json.load(r)


def gate_state(base: str, key: str, template: str) -> str:
    """The template's gate entry on any worker (``/kvmesh/workers``), e.g. 'calibrating r=0.3 3/16'."""
    for w in call(base, key, "/kvmesh/workers")["workers"]:
        gates = ((w.get("engine") or {}).get("approx") or {}).get("gate") or {}
        for name, g in gates.items():
            if name.endswith("/" + template):
                return f"{g['state']} r={g['r']} checks={g['checks']} failures={g['failures']}"
    return "-"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--api-key", default="sk-acme-demo")  # a key of cluster/tenants.yaml
    ap.add_argument("--requests", type=int, default=len(TEXTS))
    args = ap.parse_args()
    print("registered:", call(args.base_url, args.api_key, "/v1/templates", {"id": "fr", "template": TEMPLATE}))
    client = OpenAI(base_url=args.base_url + "/v1", api_key=args.api_key)
    model = client.models.list().data[0].id
    for i in range(args.requests):
        text = TEXTS[i % len(TEXTS)]
        r = client.completions.create(
            model=model, prompt=TEMPLATE.replace("{text}", text), max_tokens=16, temperature=0,
            extra_body={"kvmesh": {"reuse": "approximate", "template": "fr", "params": {"text": text}}})
        kv = r.model_extra["kvmesh"]
        print(f"{i:2d} approx {kv['approx_cached_tokens']:3d} exact {kv['exact_cached_tokens']:3d} "
              f"of {r.usage.prompt_tokens} | gate {gate_state(args.base_url, args.api_key, 'fr'):40s} | "
              f"{r.choices[0].text.strip()[:40]!r}")


if __name__ == "__main__":
    main()
