"""Session fixtures for the eager-backend suite: each tiny model directory is built once, and
one eager Model per architecture is loaded once and shared (tests never mutate it: steering is
scoped to ``with steer(...)`` blocks and monkeypatches are undone). ``model_pool`` comes from
the repository's root conftest.

Models load lazily, so running one file or one arch loads only what it uses.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

from interp_engine.testing import TINY_ARCHS, tiny_model  # noqa: E402

# The tiny models are far too small to gain from intra-op threads, and on a shared 2-core
# machine OpenMP workers contend (a 3-layer forward goes from ~3 ms to ~200 ms).
torch.set_num_threads(int(os.environ.get("INTERP_ENGINE_TEST_THREADS", "1")))

ARCHS = TINY_ARCHS


class _Lazy(dict):
    """arch -> value, built on first lookup."""

    def __init__(self, build) -> None:
        super().__init__()
        self._build = build

    def __missing__(self, arch: str):
        value = self[arch] = self._build(arch)
        return value


@pytest.fixture(scope="session")
def tiny_dirs():
    """arch -> tiny model directory (built on first use, then reused)."""
    return _Lazy(tiny_model)


@pytest.fixture(scope="session")
def eager_models(model_pool):
    """arch -> one shared eager ``Model`` (float32, frozen parameters), from the root
    conftest's session pool (the vLLM tests compare against the same instances)."""
    return _Lazy(lambda arch: model_pool.get(arch, "eager"))


@pytest.fixture(scope="session")
def hf_copies(tiny_dirs):
    """arch -> an independent HF copy (eager attention, as the eager backend runs), for what
    HF reports itself: hidden states, attention probabilities. Asking for those installs
    transformers' output-recording hooks for good, so never on the shared models."""
    from transformers import AutoModelForCausalLM

    def load(arch):
        model = AutoModelForCausalLM.from_pretrained(tiny_dirs[arch], dtype=torch.float32,
                                                     attn_implementation="eager")
        return model.eval()

    return _Lazy(load)


@pytest.fixture(params=ARCHS)
def arch(request) -> str:
    return request.param


@pytest.fixture
def eager_model(eager_models, arch):
    return eager_models[arch]


@pytest.fixture(autouse=True)
def _no_grad_leak():
    """Tests run with autograd on (as users do); make sure none leaves it off."""
    yield
    assert torch.is_grad_enabled(), "a test left torch grad mode disabled"
