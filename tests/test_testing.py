"""Tests for interp_engine.testing: the on-disk tiny-model factory."""

from __future__ import annotations

import dataclasses
import pathlib
import threading

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

import specs
from interp_engine import testing
from interp_engine.testing import (
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    MOE_ARCHS,
    TINY_ARCHS,
    TINY_VARIANTS,
    TOKENIZER_VOCAB_SIZE,
    VLLM_ARCHS,
    tiny_config,
    tiny_graph,
    tiny_model,
)
from specs import SPECS

# What each spec file declares (the registry), read here rather than listed again.
ADDS_BOS = {arch for arch in TINY_ARCHS if SPECS[arch].tiny["tiny"].adds_bos}
CLASS_NAMES = {arch: SPECS[arch].hf_classes for arch in TINY_ARCHS}
TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "café naïve Ünïcödé 日本語 🙂👍🏽 ∑√π",
    "  leading spaces,\ttabs\nand newlines\n",
    "Never seen: Ωμέγα ქართული עברית 🦜",
)
PROMPTS = ("The quick brown fox", "Paris is the capital of", "def add(a, b):",
           "Numbers: 1, 2, 3,", "café naïve 🙂")


@pytest.fixture(scope="session")
def root(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """One root holding every tiny model, built once for the session."""
    base = tmp_path_factory.mktemp("tiny-models")
    for arch in TINY_ARCHS:
        tiny_model(arch, root=base)
    return base


@pytest.fixture(scope="session")
def loaded(root: pathlib.Path) -> dict[str, tuple[PreTrainedModel, PreTrainedTokenizerBase]]:
    """arch -> (HF model, tokenizer), loaded once from the session root."""
    out = {}
    for arch in TINY_ARCHS:
        path = tiny_model(arch, root=root)
        out[arch] = (AutoModelForCausalLM.from_pretrained(path).eval(),
                     AutoTokenizer.from_pretrained(path))
    return out


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_loads_as_the_real_architecture(arch: str, root: pathlib.Path, loaded) -> None:
    model, tokenizer = loaded[arch]
    path = tiny_model(arch, root=root)
    assert path.parent == root and path.name.startswith(f"tiny-{arch}-tiny-")
    assert type(model).__name__ in CLASS_NAMES[arch]
    assert model.config.architectures == [type(model).__name__]
    assert model.config.model_type in SPECS[arch].model_types
    assert model.dtype == torch.float32
    assert model.config.dtype == torch.float32
    assert tiny_graph(arch).d_head >= 32  # vLLM's CPU attention needs head_dim >= 32
    assert model.config.vocab_size == len(tokenizer) == TOKENIZER_VOCAB_SIZE
    assert (path / "model.safetensors").is_file()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_no_tensor_is_left_constant(arch: str, loaded) -> None:
    model, _ = loaded[arch]
    constant = [name for name, param in model.named_parameters()
                if param.numel() > 1 and bool((param == param.reshape(-1)[0]).all())]
    assert not constant
    if arch == "deepseek_v4":
        table = model.model.layers[0].mlp.gate.tid2eid  # hash routing: token id -> experts
        assert table.shape == (TOKENIZER_VOCAB_SIZE, model.config.num_experts_per_tok)
        assert (table[:, 0] != table[:, 1]).all()
        assert set(table.unique().tolist()) == set(range(model.config.n_routed_experts))


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_forward(arch: str, loaded) -> None:
    model, tokenizer = loaded[arch]
    ids = tokenizer(["Hello there, world!"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], TOKENIZER_VOCAB_SIZE)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tokenizer_round_trips(arch: str, loaded) -> None:
    _, tokenizer = loaded[arch]
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Rare multi-byte characters are split over several byte-level tokens.
    assert len(tokenizer("日", add_special_tokens=False)["input_ids"]) > 1
    assert len(tokenizer("🦜", add_special_tokens=False)["input_ids"]) > 1


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_special_tokens(arch: str, root: pathlib.Path, loaded) -> None:
    model, tokenizer = loaded[arch]
    ids = tokenizer("hello")["input_ids"]
    plain = tokenizer("hello", add_special_tokens=False)["input_ids"]
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == EOS_TOKEN_ID
    assert tokenizer.pad_token_id == EOS_TOKEN_ID
    assert model.config.eos_token_id == model.config.pad_token_id == EOS_TOKEN_ID
    generation = GenerationConfig.from_pretrained(tiny_model(arch, root=root))
    assert generation.do_sample is False
    assert generation.eos_token_id == generation.pad_token_id == EOS_TOKEN_ID
    if arch in ADDS_BOS:
        assert ids == [BOS_TOKEN_ID, *plain]
        assert tokenizer.bos_token_id == model.config.bos_token_id == BOS_TOKEN_ID
        assert generation.bos_token_id == BOS_TOKEN_ID
    else:
        assert ids == plain
        assert tokenizer.bos_token is None and model.config.bos_token_id is None


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_decoding_is_not_degenerate(arch: str, loaded) -> None:
    """Engines differing by ~1e-6 must agree on greedy tokens: no near-ties, no instant EOS."""
    model, tokenizer = loaded[arch]
    margins, next_tokens = [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = model(ids).logits[0]
        top2 = logits.topk(2, dim=-1).values
        margins += (top2[:, 0] - top2[:, 1]).tolist()
        next_tokens.append(int(logits[-1].argmax()))
    assert (torch.tensor(margins) > 1e-3).float().mean() >= 0.9, margins
    assert next_tokens.count(EOS_TOKEN_ID) <= 1, next_tokens
    ids = tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        generated = model.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:]
    assert len(set(generated.tolist())) >= 4, generated


def _snapshot(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_builds_are_byte_identical(root: pathlib.Path, tmp_path: pathlib.Path) -> None:
    for arch in TINY_ARCHS:
        first, second = tiny_model(arch, root=root), tiny_model(arch, root=tmp_path)
        assert first.name == second.name
        assert _snapshot(first) == _snapshot(second), arch


def test_reuses_existing_directory(root: pathlib.Path) -> None:
    path = tiny_model("qwen3", root=root)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny_model("qwen3", root=str(root)) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert not [p for p in root.iterdir() if p.is_dir() and p.name.startswith(".")]


def test_default_root_from_env_and_rng_untouched(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv(testing.CACHE_ENV_VAR, str(tmp_path))
    assert testing.default_root() == tmp_path
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    path = tiny_model("llama")
    assert path.parent == tmp_path
    assert torch.equal(torch.get_rng_state(), state)
    monkeypatch.delenv(testing.CACHE_ENV_VAR)
    assert testing.default_root() == pathlib.Path.home() / ".cache" / "interp_engine"


def test_concurrent_builders_agree(tmp_path: pathlib.Path) -> None:
    results: list[pathlib.Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            results.append(tiny_model("gemma2", root=tmp_path))
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == [results[0].name]
    AutoTokenizer.from_pretrained(results[0])


def test_recipe_changes_directory_name(monkeypatch: pytest.MonkeyPatch) -> None:
    recipe, config = testing._lookup("qwen3", "tiny"), tiny_config("qwen3")
    name = testing._directory_name(recipe, config)
    assert name.startswith("tiny-qwen3-tiny-")
    assert testing._directory_name(dataclasses.replace(recipe, seed=recipe.seed + 1), config) != name
    deeper = tiny_config("qwen3")
    deeper.num_hidden_layers = 4
    assert testing._directory_name(recipe, deeper) != name
    monkeypatch.setattr(testing, "FORMAT_VERSION", testing.FORMAT_VERSION + 1)
    assert testing._directory_name(recipe, config) != name
    monkeypatch.undo()
    pairs = [(a, v) for v, archs in TINY_VARIANTS.items() for a in archs]
    names = {testing._directory_name(testing._lookup(a, v), tiny_config(a, v)) for a, v in pairs}
    assert len(names) == len(pairs)


@pytest.mark.parametrize(("arch", "variant", "fragments"), [
    ("no_such_arch", "tiny", ["'no_such_arch'", *TINY_ARCHS]),
    ("qwen3", "huge", ["'huge'", "tiny", "bench"]),
    ("llama", "bench", ["'bench'", "'llama'", "tiny"]),
])
def test_unknown_arch_or_variant(arch: str, variant: str, fragments: list[str],
                                 tmp_path: pathlib.Path) -> None:
    calls = (lambda: tiny_config(arch, variant), lambda: tiny_model(arch, variant, root=tmp_path))
    for call in calls:
        with pytest.raises(ValueError) as info:
            call()
        for fragment in fragments:
            assert fragment in str(info.value)
    assert not list(tmp_path.iterdir())


def test_bench_config_size() -> None:
    config = tiny_config("qwen3", "bench")
    assert config.head_dim >= 32 and config.dtype == torch.float32
    assert config.vocab_size == TOKENIZER_VOCAB_SIZE
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    assert 20_000_000 <= parameters <= 30_000_000, parameters


# ---- the registry: every list derives from the spec files ------------------------------------

def test_lists_derive_from_the_registry() -> None:
    assert set(TINY_ARCHS) == {a for a, s in SPECS.items() if "tiny" in s.tiny}
    assert set(VLLM_ARCHS) == {a for a in TINY_ARCHS if SPECS[a].vllm}
    assert set(MOE_ARCHS) == {a for a in TINY_ARCHS if tiny_graph(a).n_experts}
    for variant, archs in TINY_VARIANTS.items():
        assert set(archs) == {a for a, s in SPECS.items() if variant in s.tiny}
    for arch, spec in SPECS.items():
        assert spec.hf_classes, f"specs/{arch}.py declares no HF architecture class"


def test_a_new_spec_file_is_all_it_takes(tmp_path: pathlib.Path, monkeypatch) -> None:
    """A spec file dropped into specs/ is found with no other line changed."""
    (tmp_path / "toy.py").write_text(
        "import dataclasses\n"
        "from specs import llama\n"
        "SPEC = dataclasses.replace(llama.SPEC, arch='toy', model_types=('toy',))\n")
    monkeypatch.setattr(specs, "__path__", [*specs.__path__, str(tmp_path)])
    found = specs._discover()
    assert "toy" in found and set(found) == set(SPECS) | {"toy"}
    assert found["toy"].tiny == SPECS["llama"].tiny


@pytest.mark.parametrize(("arch", "low", "high"), [("gpt2", 120e6, 130e6), ("gpt_neox", 155e6, 170e6)])
def test_full_size_configs(arch: str, low: float, high: float) -> None:
    """GPT-2 small (124M) and Pythia-160M shapes with random weights, for benchmarks."""
    config = tiny_config(arch, "full")
    assert config.dtype == torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for p in model.parameters())
    assert low <= parameters <= high, parameters
    assert tiny_graph(arch, "full").n_layers == 12
