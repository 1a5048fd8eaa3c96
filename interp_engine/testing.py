"""Tiny, real Hugging Face models built on disk for tests and benchmarks.

Model weights cannot be downloaded in CI, so this module builds small random
checkpoints of real ``transformers`` architectures locally, once, and reuses
them afterwards::

    from interp_engine.testing import TINY_ARCHS, tiny_config, tiny_model

    path = tiny_model("qwen3")                 # pathlib.Path to a model directory
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    llm = vllm.LLM(model=str(path), dtype="float32")  # vLLM loads it too

``TINY_ARCHS`` lists the architectures, from the spec registry: every file
under ``specs/`` whose ``SPEC`` carries a ``tiny`` recipe (``TinyRecipe``:
config class and overrides, seed, weight tweaks, whether ``<bos>`` is
prepended).  ``VLLM_ARCHS`` are those whose spec has a vLLM map and
``MOE_ARCHS`` those with routed experts; ``TINY_VARIANTS`` maps each variant
(``"tiny"``: 3 layers, hidden size 128, heads of 32, float32; ``"bench"``: a
random Qwen3 of about 26M parameters for benchmarks) to its archs.
``tiny_config(arch, variant)`` returns the configuration and
``tiny_graph(arch, variant)`` the ``ModelGraph`` without building anything.
Adding an architecture adds no line here.

Each directory holds the real config and model classes' ``save_pretrained``
output (safetensors, float32), a ``generation_config.json`` with greedy
defaults, and a byte-level BPE tokenizer of 512 tokens trained with the
``tokenizers`` library on a fixed built-in corpus (``decode(encode(s)) == s``
for any text; rare multi-byte characters span several tokens).
``<|endoftext|>`` (id 0) is the EOS and padding token; ``<bos>`` (id 1) is
prepended automatically where the recipe says so (``adds_bos``).

Weights are the classes' own random initialization after ``torch.manual_seed``
of a fixed per-recipe seed (the caller's RNG state is left untouched), with an
``initializer_range`` of 0.1 in most recipes so that greedy decoding does
not sit on near-ties (top-1/top-2 logit margins are typically ~0.2).  Tensors
that the classes initialize to a constant (norm weights; DeepSeek-V4's
attention sinks, compressor position biases, hyper-connection bases/scales and
router correction biases) get N(0, 0.2) added, and DeepSeek-V4's hash-routing
table (all zeros at init) gets distinct random experts per token, so a backend
that ignores any of them does not match by accident.  ``gemma2`` ties its LM
head to the embeddings, as the real model and vLLM's implementation do; to
keep its greedy decoding from repeating the last token, its embedding is
scaled by 0.2 and its post-sublayer and final norm gains are raised (GPT-2,
also tied, scales its token embedding by 0.1).  Note
that transformers' default ``sdpa`` attention silently drops Gemma2's
``attn_logit_softcapping``; load it with ``attn_implementation="eager"`` to
match vLLM (which applies it) beyond ~1e-2.

Directories live under ``root``: by default ``$INTERP_ENGINE_CACHE`` if set,
else ``~/.cache/interp_engine``.  A directory is named
``tiny-<arch>-<variant>-<hash>``, where the hash covers the full config, the
tokenizer recipe, the seed and weight tweaks, ``FORMAT_VERSION`` and the
torch/transformers versions, so any change to the recipe yields a new
directory.  A build is written to a temporary directory beside its destination
and moved into place with ``os.replace`` while holding an ``fcntl.flock`` lock
on ``.<name>.lock``, so concurrent processes (e.g. pytest workers) neither race
nor see half-written models.  Builds are deterministic: the same call writes
the same bytes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
import transformers
from specs import SPECS
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

__all__ = [
    "BOS_TOKEN",
    "BOS_TOKEN_ID",
    "CACHE_ENV_VAR",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "FORMAT_VERSION",
    "MOE_ARCHS",
    "TINY_ARCHS",
    "TINY_VARIANTS",
    "VLLM_ARCHS",
    "TOKENIZER_VOCAB_SIZE",
    "default_root",
    "tiny_config",
    "tiny_graph",
    "tiny_model",
]

FORMAT_VERSION = 1
"""Bump to invalidate every cached directory (it is part of the directory hash)."""

CACHE_ENV_VAR = "INTERP_ENGINE_CACHE"

# Every list here derives from the spec registry: a spec file under specs/ with a ``tiny``
# recipe is a tiny-model arch, with no line to add here.
TINY_VARIANTS: Mapping[str, tuple[str, ...]] = MappingProxyType({
    variant: tuple(arch for arch, spec in SPECS.items() if variant in spec.tiny)
    for variant in sorted({v for spec in SPECS.values() for v in spec.tiny}, key=lambda v: (v != "tiny", v))
})
TINY_ARCHS: tuple[str, ...] = TINY_VARIANTS.get("tiny", ())
"""Architectures with a tiny model, from the spec registry (``specs.SPECS``)."""
VLLM_ARCHS: tuple[str, ...] = tuple(a for a in TINY_ARCHS if SPECS[a].vllm_served)
"""Tiny architectures that vLLM serves (their spec has a vLLM map)."""
TOKENIZER_VOCAB_SIZE = 512
EOS_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<bos>"
EOS_TOKEN_ID = 0
BOS_TOKEN_ID = 1
_SPECIAL_TOKENS = (EOS_TOKEN, BOS_TOKEN)  # trained in this order: ids 0 and 1


# --------------------------------------------------------------------------- recipes


_CONSTANT_JITTER = 0.2
"""Std of the noise added to tensors that the model classes initialize to a constant."""


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """Everything that determines one model directory's contents: a spec's ``TinyRecipe`` for
    one (arch, variant)."""

    arch: str
    variant: str
    config_class: str
    seed: int
    adds_bos: bool
    config: Mapping[str, Any]
    norm_offsets: Mapping[str, float]
    """Added to the parameters whose names end with these keys, after the jitter."""
    embedding_scale: float
    """Multiplies the input embedding matrix after initialization."""


_RECIPES: Mapping[tuple[str, str], _Recipe] = MappingProxyType({
    (arch, variant): _Recipe(arch, variant, r.config_class, r.seed, r.adds_bos, r.config,
                             r.norm_offsets, r.embedding_scale)
    for arch, spec in SPECS.items() for variant, r in spec.tiny.items()
})


def _lookup(arch: str, variant: str) -> _Recipe:
    if arch not in TINY_ARCHS:
        raise ValueError(f"unknown tiny-model arch {arch!r}; valid archs: {', '.join(TINY_ARCHS)}")
    if variant not in TINY_VARIANTS:
        raise ValueError(
            f"unknown tiny-model variant {variant!r}; valid variants: {', '.join(TINY_VARIANTS)}")
    if arch not in TINY_VARIANTS[variant]:
        valid = [v for v, archs in TINY_VARIANTS.items() if arch in archs]
        raise ValueError(
            f"variant {variant!r} is not available for arch {arch!r}; "
            f"valid variants for {arch!r}: {', '.join(valid)}")
    return _RECIPES[(arch, variant)]


def tiny_config(arch: str, variant: str = "tiny") -> transformers.PretrainedConfig:
    """The float32 ``transformers`` config of ``tiny_model(arch, variant)``, built fresh."""
    recipe = _lookup(arch, variant)
    config_class = getattr(transformers, recipe.config_class)
    bos = BOS_TOKEN_ID if recipe.adds_bos else None
    config = config_class(
        **{k: (list(v) if isinstance(v, tuple) else v) for k, v in recipe.config.items()},
        bos_token_id=bos,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
    )
    config.dtype = torch.float32
    return config


def tiny_graph(arch: str, variant: str = "tiny"):
    """The ``ModelGraph`` of ``tiny_model(arch, variant)``, from its config alone."""
    return SPECS[arch].graph_from_config(tiny_config(arch, variant))


MOE_ARCHS: tuple[str, ...] = tuple(a for a in TINY_ARCHS if tiny_graph(a).n_experts)
"""Tiny architectures with routed experts (router_logits / expert selection points)."""


# --------------------------------------------------------------------------- tokenizer

_CORPUS_SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "A journey of a thousand miles begins with a single step.",
    "She sells sea shells by the sea shore, and the shells she sells are surely seashells.",
    "How much wood would a woodchuck chuck if a woodchuck could chuck wood?",
    "In the beginning the universe was created; this has made a lot of people very angry.",
    "It was the best of times, it was the worst of times, it was the age of wisdom.",
    "Call me Ishmael. Some years ago, never mind how long precisely, I went to sea.",
    "All happy families are alike; each unhappy family is unhappy in its own way.",
    "The model reads a sequence of tokens and predicts the next one.",
    "Attention heads move information between positions in the residual stream.",
    "We patch the activation at layer two and measure the change in the logit difference.",
    "The cat sat on the mat while the dog slept by the door.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "Mary went to the store, and John gave a drink to Mary.",
    "When Alice and Bob went to the park, Bob handed the ball to Alice.",
    "Water boils at 100 degrees Celsius and freezes at 0 degrees.",
    "The train leaves at 9:45 and arrives at 13:20, platform 7.",
    "Please send the report by Friday; the meeting moved to room 204.",
    "Numbers like 3.14159, 2.71828 and 1.41421 show up everywhere.",
    "Is it raining? No, it's sunny! Really... (maybe) [probably] {certainly}.",
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i * i)\n",
    "x = {'key': [1, 2, 3], 'other': (4, 5)}  # a small dict",
    "SELECT name, age FROM users WHERE age > 21 ORDER BY name;",
    "Email: someone@example.com, URL: https://example.org/path?q=1&r=2",
    "Prices: $5.99, $12.50, 30% off, 2 for 1, #1 best seller!",
    "The café on the corner serves a naïve but charming crème brûlée.",
    "Ünïcödé text is tricky: façade, jalapeño, über, señor, Ångström.",
    "日本語のテキストも少し含めます。東京は日本の首都です。",
    "Русский текст: привет, мир. Ελληνικά: γεια σου κόσμε.",
    "Emoji: 🙂 🚀 🎉 👍🏽 ❤️ and math: ∑ ∫ √ ≈ ≠ ∞ π.",
    "Tabs\tand  double  spaces, newlines\nand a trailing space ",
    "She said, \"I'll be there at 8 o'clock,\" but she didn't come.",
    "The experiment ran 3 times with seeds 0, 1 and 2; results varied by 0.5%.",
    "Rivers flow to the sea, mountains rise to the sky, and roads run between towns.",
    "A small model with random weights still produces well defined logits.",
)


def _corpus() -> tuple[str, ...]:
    numbers = tuple(
        f"Item {i}: {i * 37 % 1000} units at {i * 1.25:.2f} each, total {i * i * 7}."
        for i in range(1, 61)
    )
    return _CORPUS_SENTENCES * 3 + numbers


@dataclasses.dataclass(frozen=True)
class _TokenizerRecipe:
    vocab_size: int
    special_tokens: tuple[str, ...]
    adds_bos: bool
    corpus_sha256: str


def _tokenizer_recipe(adds_bos: bool) -> _TokenizerRecipe:
    digest = hashlib.sha256("\x00".join(_corpus()).encode()).hexdigest()
    return _TokenizerRecipe(TOKENIZER_VOCAB_SIZE, _SPECIAL_TOKENS, adds_bos, digest)


def _train_tokenizer(adds_bos: bool) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=list(_SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    if tokenizer.get_vocab_size() != TOKENIZER_VOCAB_SIZE:
        raise RuntimeError(
            f"trained tokenizer has {tokenizer.get_vocab_size()} tokens, "
            f"expected {TOKENIZER_VOCAB_SIZE}")
    for token, expected in ((EOS_TOKEN, EOS_TOKEN_ID), (BOS_TOKEN, BOS_TOKEN_ID)):
        if tokenizer.token_to_id(token) != expected:
            raise RuntimeError(
                f"{token} got id {tokenizer.token_to_id(token)}, expected {expected}")
    if adds_bos:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{BOS_TOKEN} $A",
            pair=f"{BOS_TOKEN} $A {BOS_TOKEN}:1 $B:1",
            special_tokens=[(BOS_TOKEN, BOS_TOKEN_ID)],
        )
    return tokenizer


def _save_tokenizer(directory: pathlib.Path, adds_bos: bool, model_max_length: int) -> None:
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=_train_tokenizer(adds_bos),
        bos_token=BOS_TOKEN if adds_bos else None,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(directory)


# --------------------------------------------------------------------------- building


def default_root() -> pathlib.Path:
    """``$INTERP_ENGINE_CACHE`` if set, else ``~/.cache/interp_engine``."""
    env = os.environ.get(CACHE_ENV_VAR)
    return pathlib.Path(env) if env else pathlib.Path.home() / ".cache" / "interp_engine"


def _directory_name(recipe: _Recipe, config: transformers.PretrainedConfig) -> str:
    config_dict = config.to_dict()
    config_dict.pop("transformers_version", None)
    key = {
        "format_version": FORMAT_VERSION,
        "arch": recipe.arch,
        "variant": recipe.variant,
        "seed": recipe.seed,
        "constant_jitter": _CONSTANT_JITTER,
        "embedding_scale": recipe.embedding_scale,
        "norm_offsets": dict(recipe.norm_offsets),
        "config": config_dict,
        "tokenizer": dataclasses.asdict(_tokenizer_recipe(recipe.adds_bos)),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    blob = json.dumps(key, sort_keys=True, default=str).encode()
    return f"tiny-{recipe.arch}-{recipe.variant}-{hashlib.sha256(blob).hexdigest()[:12]}"


def _build(recipe: _Recipe, config: transformers.PretrainedConfig, directory: pathlib.Path) -> None:
    with torch.random.fork_rng(devices=[]):  # leave the caller's RNG state alone
        torch.manual_seed(recipe.seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize_constant_tensors(model, recipe.norm_offsets)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(recipe.embedding_scale)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    model.save_pretrained(directory)
    _save_tokenizer(directory, recipe.adds_bos, config.max_position_embeddings)


def _randomize_constant_tensors(model: torch.nn.Module, offsets: Mapping[str, float]) -> None:
    """Give every tensor that the classes initialize to a constant a seeded random value.

    Trained checkpoints hold no constant tensors, but a fresh model does: norm weights (ones,
    or zeros for Gemma's ``1 + weight``), DeepSeek-V4's attention sinks, compressor position
    biases, hyper-connection bases and scales, router correction biases, and its all-zero
    token-to-expert hash table.  Left constant, a backend that ignores them would still match.
    ``offsets`` are then added to the parameters whose names end with their keys.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.numel() and bool((param == param.reshape(-1)[0]).all()):
                param.add_(torch.randn_like(param), alpha=_CONSTANT_JITTER)
            for suffix, offset in offsets.items():
                if name == suffix or name.endswith("." + suffix):
                    param.add_(offset)
        for module in model.modules():
            bias = getattr(module, "e_score_correction_bias", None)
            if isinstance(bias, torch.Tensor):
                bias.add_(torch.randn_like(bias), alpha=_CONSTANT_JITTER)
            table = getattr(module, "tid2eid", None)
            if isinstance(table, torch.Tensor):  # distinct experts for every token id
                draws = torch.rand(table.shape[0], module.num_experts)
                table.copy_(draws.argsort(dim=-1)[:, : table.shape[1]])


@contextlib.contextmanager
def _locked(lock_path: pathlib.Path) -> Iterator[None]:
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def tiny_model(arch: str, variant: str = "tiny", *,
               root: str | os.PathLike[str] | None = None) -> pathlib.Path:
    """Path of the model directory for ``(arch, variant)``, building it on first use.

    The directory loads with ``AutoModelForCausalLM.from_pretrained``,
    ``AutoTokenizer.from_pretrained`` and ``vllm.LLM(model=str(path))``.
    Raises ``ValueError`` for an unknown ``arch`` or ``variant``.
    """
    recipe = _lookup(arch, variant)
    config = tiny_config(arch, variant)
    base = pathlib.Path(root) if root is not None else default_root()
    target = base / _directory_name(recipe, config)
    if target.is_dir():
        return target
    base.mkdir(parents=True, exist_ok=True)
    with _locked(base / f".{target.name}.lock"):
        if target.is_dir():  # another process built it while we waited
            return target
        for stale in base.glob(f".{target.name}.*"):  # left by a builder that was killed
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=base))
        staging.chmod(0o755)
        try:
            _build(recipe, config, staging)
            for file in staging.iterdir():
                file.chmod(0o644)  # safetensors writes 0600; cached models are shared read-only
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target


def assert_close_scaled(actual: torch.Tensor, expected: torch.Tensor, tol: float = 1e-5, msg: str = "") -> None:
    """Assert two captures agree to ``tol`` relative to the expected tensor's scale
    (``max |a - b| <= tol * max(1, max |b|)``): what "the same numbers in fp32" means across
    engines whose fused kernels reduce in another order (on a residual of norm ~40 an element
    may differ by ~1e-4 while the worst error is ~4e-6 of the scale)."""
    if actual.shape != expected.shape:
        raise AssertionError(f"{msg}: shapes differ, {tuple(actual.shape)} vs {tuple(expected.shape)}")
    scale = max(1.0, float(expected.abs().max())) if expected.numel() else 1.0
    err = float((actual.float() - expected.float()).abs().max()) if expected.numel() else 0.0
    if not err <= tol * scale:
        raise AssertionError(f"{msg}: max |diff| {err:.3g} > {tol} x scale {scale:.3g}")
