import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from engine.model_loader import load_model  # noqa: E402


@pytest.fixture(scope="session")
def default_model():
    """SmolLM2-135M-Instruct, loaded once per test session (shared, read-only)."""
    return load_model("default")


@pytest.fixture(scope="session")
def tiny_model():
    return load_model("tiny-llama")
