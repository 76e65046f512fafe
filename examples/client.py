"""Talk to a running kvmesh with the official OpenAI client.

    serve run cluster/serve.yaml            # or: make serve   (in another terminal)
    .venv/bin/python examples/client.py [--base-url http://127.0.0.1:8000/v1] [--api-key sk-acme-demo]

Shows a completion, a repeat that reuses the prompt's KV (usage.prompt_tokens_details.cached_tokens
and the kvmesh object), a baseline with reuse "none" and a streamed chat completion.
"""

import argparse

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    ap.add_argument("--api-key", default="sk-acme-demo")  # a key of cluster/tenants.yaml
    args = ap.parse_args()
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = client.models.list().data[0].id
    print(f"model: {model}")

    system = "You are a concise assistant for the ACME corporation. Answer in one sentence. " * 4
    prompt = system + "\nQuestion: what is a KV cache?\nAnswer:"
    for label, reuse in (("first", "exact"), ("repeat", "exact"), ("baseline", "none")):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0,
                                      extra_body={"kvmesh": {"reuse": reuse}})
        kv = r.model_extra["kvmesh"]
        print(f"{label:>8}: cached {r.usage.prompt_tokens_details.cached_tokens}/{r.usage.prompt_tokens} "
              f"prompt tokens on {kv['worker']} ({kv['route']}): {r.choices[0].text!r}")

    print("chat (streamed): ", end="", flush=True)
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Name three colours."}],
        max_tokens=32, temperature=0, stream=True)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
