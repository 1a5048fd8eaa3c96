"""The README's example block runs as written (its vLLM part where vllm is installed)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_the_readme_example_runs():
    blocks = _python_blocks()
    assert blocks, "the README lost its example"
    code = blocks[0]
    if importlib.util.find_spec("vllm") is None:
        code = code.split("vmodel = ")[0]  # the eager half
    namespace: dict = {}
    exec(compile(code, str(README), "exec"), namespace)
    assert namespace["logprobs"].shape[0] == namespace["model"].n_layers
    if "vmodel" in namespace:
        assert isinstance(namespace["text"], str) and namespace["values"]
        namespace["vmodel"].close()


@pytest.mark.parametrize("command", ["./scripts/demo.sh", "./scripts/test.sh"])
def test_the_readme_names_the_two_commands(command):
    assert command in README.read_text()
    assert (README.parent / command).exists()
