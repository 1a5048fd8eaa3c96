"""The registry as the docs describe it: docs/vllm.md's architecture table names every spec,
its HF class and how vLLM runs it (native, the Transformers backend door, or refused)."""

from __future__ import annotations

import re
from pathlib import Path

from specs import SPECS

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def _door(spec) -> str:
    if not spec.vllm_served:
        return "refused"
    return "Transformers backend" if spec.vllm_model_impl == "transformers" else "native"


def test_the_docs_table_is_the_registry():
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| (.+?) \|$", DOC.read_text(), flags=re.M)
    table = {arch: (cls, how) for arch, cls, how in rows}
    assert set(table) == set(SPECS), "docs/vllm.md's architecture table and specs/ differ"
    for arch, spec in SPECS.items():
        cls, how = table[arch]
        assert cls in spec.hf_classes, arch
        assert how.startswith(_door(spec)), (arch, how)
