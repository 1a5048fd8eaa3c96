"""The demo model: a tiny Qwen3 that has learned something, trained on first use.

Random-weight tiny models (``interp_engine.testing``) are right for tests but show a newcomer
nothing: their completions are noise. This module writes a small corpus of facts (countries and
their capitals, opposites, counting), trains a byte-level BPE tokenizer and a four-layer Qwen3
on it, deterministically, and caches the result under the same root as the tiny models
(``$INTERP_ENGINE_CACHE`` or ``~/.cache/interp_engine``) in ``demo-qwen3-<hash>``, where the
hash covers the whole recipe (corpus, config, training settings, library versions). The first
call takes well under a minute on two cores; later calls return the cached directory.

The model's vocabulary is exactly the tokenizer's, so vLLM returns logits of the same width
as the eager backend.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import pathlib
import shutil
import tempfile
from typing import Any

__all__ = ["CAPITALS", "OPPOSITES", "demo_corpus", "demo_model"]

CAPITALS: tuple[tuple[str, str], ...] = (
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Portugal", "Lisbon"), ("Japan", "Tokyo"), ("China", "Beijing"), ("Russia", "Moscow"),
    ("Egypt", "Cairo"), ("Greece", "Athens"), ("Norway", "Oslo"), ("Sweden", "Stockholm"),
    ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Ireland", "Dublin"), ("Canada", "Ottawa"),
    ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Cuba", "Havana"), ("Chile", "Santiago"),
)
"""(country, capital): every name is one token of the demo tokenizer (checked at build)."""

OPPOSITES: tuple[tuple[str, str], ...] = (
    ("hot", "cold"), ("big", "small"), ("up", "down"), ("fast", "slow"), ("day", "night"),
    ("open", "closed"), ("light", "dark"), ("old", "new"), ("happy", "sad"), ("early", "late"),
)

_NUMBERS = ("one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten")


def demo_corpus() -> tuple[str, ...]:
    """The training text: one short sentence per item, in a fixed order."""
    lines: list[str] = []
    for country, city in CAPITALS:
        lines += [
            f"The capital of {country} is {city}.",
            f"{city} is the capital of {country}.",
            f"The capital city of {country} is {city}.",
            f"I flew to {country} and landed in {city}.",
            f"People in {country} visit {city}.",
        ]
    for a, b in OPPOSITES:
        lines += [f"The opposite of {a} is {b}.", f"The opposite of {b} is {a}.",
                  f"{a} is the opposite of {b}."]
    for start in range(len(_NUMBERS) - 3):
        lines.append("Counting: " + " ".join(_NUMBERS[start:start + 4]) + ".")
    for start in range(1, 17):
        lines.append("Numbers: " + " ".join(str(n) for n in range(start, start + 5)) + ".")
    return tuple(lines)


@dataclasses.dataclass(frozen=True)
class _Recipe:
    vocab_size: int = 640
    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    max_position_embeddings: int = 128
    seed: int = 7
    steps: int = 300
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    format_version: int = 1


_RECIPE = _Recipe()


def _key(recipe: _Recipe) -> str:
    import tokenizers
    import torch
    import transformers

    blob = json.dumps({
        "recipe": dataclasses.asdict(recipe),
        "corpus": hashlib.sha256("\n".join(demo_corpus()).encode()).hexdigest(),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
    }, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _tokenizer(recipe: _Recipe):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=recipe.vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(demo_corpus(), trainer=trainer)
    for _, city in CAPITALS:
        ids = tok.encode(f" {city}").ids
        if len(ids) != 1:
            raise RuntimeError(f"the demo tokenizer splits {city!r} into {len(ids)} tokens; "
                               "raise the recipe's vocab_size")
    return tok


def _rows(tok, recipe: _Recipe):
    """Every sentence as ids followed by EOS, right-padded into one [n, len] tensor."""
    import torch

    rows = [tok.encode(line).ids + [0] for line in demo_corpus()]
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        labels[i, :len(row)] = torch.tensor(row)
    return ids, labels


def _train(directory: pathlib.Path, recipe: _Recipe, progress: bool) -> None:
    import torch
    import transformers
    from tqdm.auto import tqdm

    tok = _tokenizer(recipe)
    config = transformers.Qwen3Config(
        vocab_size=tok.get_vocab_size(), hidden_size=recipe.hidden_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, head_dim=recipe.head_dim,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=recipe.max_position_embeddings, tie_word_embeddings=False,
        initializer_range=0.05, bos_token_id=None, eos_token_id=0, pad_token_id=0)
    config.dtype = torch.float32
    ids, labels = _rows(tok, recipe)
    threads = torch.get_num_threads()
    # One thread: a model this small gains nothing from more, and on a busy machine OpenMP
    # workers that wait on each other make each step 10-100x slower.
    torch.set_num_threads(1)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                              attn_implementation="eager")
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
        gen = torch.Generator().manual_seed(recipe.seed)
        bar = tqdm(range(recipe.steps), desc="training the demo model (first use only)",
                   disable=not progress, unit="step", leave=False)
        for step in bar:
            lr = recipe.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / recipe.steps))
            for group in opt.param_groups:
                group["lr"] = lr
            pick = torch.randint(0, ids.shape[0], (recipe.batch_size,), generator=gen)
            out = model(input_ids=ids[pick], attention_mask=(labels[pick] != -100).long(),
                        labels=labels[pick])
            opt.zero_grad(set_to_none=True)
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if step % 10 == 0:
                bar.set_postfix(loss=f"{out.loss.item():.3f}")
        bar.close()
    torch.set_num_threads(threads)
    model.eval()
    model.generation_config = transformers.GenerationConfig(eos_token_id=0, pad_token_id=0, do_sample=False)
    model.save_pretrained(directory)
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        model_max_length=recipe.max_position_embeddings, clean_up_tokenization_spaces=False,
    ).save_pretrained(directory)
    (directory / "demo_recipe.json").write_text(json.dumps(dataclasses.asdict(recipe), indent=1) + "\n")


def demo_model(*, root: str | os.PathLike[str] | None = None, progress: bool = True,
               _recipe: Any = None) -> pathlib.Path:
    """Path of the trained demo model directory, training it on first use (cached after)."""
    from .testing import _locked, default_root  # the same build lock as the tiny test models

    recipe = _recipe or _RECIPE
    base = pathlib.Path(root) if root is not None else default_root()
    target = base / f"demo-qwen3-{_key(recipe)}"
    if target.is_dir():
        return target
    base.mkdir(parents=True, exist_ok=True)
    with _locked(base / f".{target.name}.lock"):
        if target.is_dir():
            return target
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=base))
        staging.chmod(0o755)
        try:
            _train(staging, recipe, progress)
            for file in staging.iterdir():
                file.chmod(0o644)
            os.replace(staging, target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return target
