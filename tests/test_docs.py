"""Every ```python block in docs/ runs: the blocks of one page in order, sharing one namespace
(a page reads as one session). Blocks that start with ``# vllm`` need an engine and run in the
vLLM test only; the others run on eager with tiny models. Links between pages resolve."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = sorted(DOCS.glob("*.md"))


def _blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S)


def _is_vllm(block: str) -> bool:
    return block.lstrip().startswith("# vllm")


def _run(page: Path, blocks: list[str]) -> None:
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{page}:block{i}", "exec"), namespace)


def test_the_pages_exist():
    names = {p.stem for p in PAGES}
    assert {"getting-started", "capture", "generation", "steering", "logit-lens", "capabilities", "vllm"} <= names


@pytest.mark.parametrize("page", [p for p in PAGES if any(not _is_vllm(b) for b in _blocks(p))], ids=lambda p: p.stem)
def test_the_eager_blocks_run(page, capsys):
    _run(page, [b for b in _blocks(page) if not _is_vllm(b)])


@pytest.mark.vllm
@pytest.mark.parametrize("page", [p for p in PAGES if any(_is_vllm(b) for b in _blocks(p))], ids=lambda p: p.stem)
def test_the_vllm_blocks_run(page, capsys):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (INTERP_ENGINE_SKIP_VLLM=1 set-up)")
    _run(page, [b for b in _blocks(page) if _is_vllm(b)])


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_links_between_pages_resolve(page):
    for target in re.findall(r"\]\(([^)#]+\.md)\)", page.read_text()):
        assert (DOCS / target).is_file(), f"{page.name} links to missing {target}"
