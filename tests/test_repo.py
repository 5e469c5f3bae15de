"""Repository hygiene: CI runs the README's Quickstart commands, and the code is ruff-clean."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_both_readme_quickstart_commands_verbatim():
    ci = (ROOT / ".ci/run").read_text()
    commands = dict(re.findall(r"^(FIRST|TEST)='(.+)'$", ci, re.MULTILINE))
    assert set(commands) == {"FIRST", "TEST"}
    assert 'eval "$FIRST"' in ci and 'eval "$TEST"' in ci
    readme_lines = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()]
    for command in commands.values():
        assert command in readme_lines, f"README.md has no line {command!r}"
    # The first command is the first one a reader meets, the test command the second.
    code_lines = [line for line in readme_lines if line.startswith("pip install")]
    assert code_lines[:2] == [commands["FIRST"], commands["TEST"]]


@pytest.mark.skipif(shutil.which("ruff") is None, reason="ruff is part of the test extras")
def test_ruff_clean():
    for args in (["check"], ["format", "--check"]):
        result = subprocess.run(["ruff", *args, "."], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr


# The layers, lowest first: a module imports from its own layer or the ones below it.
LAYERS = [
    ("kernels_pallas",),  # attention kernels and the KV layout
    ("models",),  # the model as pure functions over the pool
    ("pagedjax.core", "pagedjax.errors", "pagedjax.sampling_params"),  # host side, no JAX
    ("pagedjax",),  # the engine, its platforms and its APIs
]
# Where platform differences may live: only these import the CPU's native kernels.
CPU_NATIVE_USERS = ("pagedjax/platforms/", "pagedjax/cpu_native/")


def _layer(module: str) -> int | None:
    """The layer of the longest prefix the module matches; None outside the project."""
    matches = [
        (len(prefix), index)
        for index, prefixes in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(matches)[1] if matches else None


def _runtime_imports(path: Path) -> set[str]:
    """Absolute modules a file imports when it runs (imports under TYPE_CHECKING excluded)."""
    import ast

    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for n in ast.walk(node))
    modules = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def _package_files() -> list[tuple[str, Path]]:
    files = []
    for package in ("kernels_pallas", "models", "pagedjax"):
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).with_suffix("")
            module = ".".join(relative.parts).removesuffix(".__init__")
            files.append((module, path))
    return files


def test_nothing_imports_upward():
    problems = []
    for module, path in _package_files():
        own = _layer(module)
        for imported in _runtime_imports(path):
            layer = _layer(imported)
            if layer is not None and layer > own:
                problems.append(f"{module} (layer {own}) imports {imported} (layer {layer})")
    assert not problems, "\n".join(problems)


def test_core_imports_no_jax_and_models_no_native_kernels():
    for module, path in _package_files():
        imports = _runtime_imports(path)
        roots = {name.split(".")[0] for name in imports}
        if module.startswith("pagedjax.core"):
            assert not roots & {"jax", "jaxlib", "numpy"}, (module, roots)
        relative = path.relative_to(ROOT).as_posix()
        if not relative.startswith(CPU_NATIVE_USERS):
            native = [name for name in imports if name.startswith("pagedjax.cpu_native")]
            assert not native, f"{relative} imports {native}: only the platform chooses them"


def test_importing_the_core_imports_no_jax():
    code = "import sys, pagedjax.core.scheduler; print('jax' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert result.stdout.strip() == "False"


MAX_FUNCTION_LINES = 100


def test_no_function_is_longer_than_a_reader_can_hold():
    """A function past MAX_FUNCTION_LINES lines (docstring included) is split where a reader
    would: in the packages, the benchmarks and the examples."""
    import ast

    long = []
    for folder in ("kernels_pallas", "models", "pagedjax", "benchmarks", "examples"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {lines}")
    assert not long, "split these functions:\n" + "\n".join(long)
