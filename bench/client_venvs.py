"""Own venvs for the third-party load generators (aiperf, guidellm), outside the repo.

Each tool gets ``$KVMESH_CACHE/venv-<tool>`` (default ``~/.cache/kvmesh``), created once with
Python 3.11 (both tools accept it; torch's CPU wheel that guidellm needs is pinned first, so pip
never pulls a CUDA build) and the pinned release installed from the package registry. A venv is
reused when its executable exists and ``pip show`` reports the pinned version.

    python bench/client_venvs.py            # both
    python bench/client_venvs.py aiperf     # one
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.ipperf import CACHE, find_python  # noqa: E402  (the same cache as inference-perf's venv)

# tool -> (pinned version, executable name, packages installed before the tool itself)
TOOLS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "aiperf": ("0.13.0", "aiperf", ()),
    "guidellm": ("0.8.1", "guidellm", ("torch==2.13.0",)),
}


def find_python311() -> str:
    """A Python 3.11 interpreter (``python3.11`` on PATH, else pyenv's)."""
    return find_python(("python3.11",), "3.11*/bin/python3.11", "sys.version_info[:2] == (3, 11)",
                       "no Python 3.11 found (python3.11 or pyenv)")


def venv_dir(tool: str, cache: Path = CACHE) -> Path:
    return cache / f"venv-{tool}"


def installed_version(tool: str, cache: Path = CACHE) -> str | None:
    pip = venv_dir(tool, cache) / "bin" / "pip"
    if not pip.exists():
        return None
    out = subprocess.run([str(pip), "show", tool], capture_output=True, text=True).stdout
    for line in out.splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


def ensure_venv(tool: str, cache: Path = CACHE) -> Path:
    """The tool's executable in its own venv (created and installed at low CPU priority once)."""
    version, exe_name, pre = TOOLS[tool]
    venv = venv_dir(tool, cache)
    exe = venv / "bin" / exe_name
    if exe.exists() and installed_version(tool, cache) == version:
        return exe
    if not (venv / "bin" / "python").exists():
        subprocess.run([find_python311(), "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "pip"), "install", "-q"]
    nice = ["nice", "-n", "19"]
    if pre:
        subprocess.run(nice + pip + list(pre), check=True)
    subprocess.run(nice + pip + [f"{tool}=={version}"], check=True)
    return exe


def main(argv: list[str]) -> int:
    for tool in argv or list(TOOLS):
        exe = ensure_venv(tool)
        print(f"{tool} {installed_version(tool)}: {exe}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
