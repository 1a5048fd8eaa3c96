"""Loading a model: resolve the name, read the config, build the graph, start a backend."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Sequence

import torch

from ._address import Address
from ._capabilities import CapabilityUnsupported
from ._graph import GradSupport, ModelGraph, ResidualBasis
from ._points import PointSpec
from ._tokens import TokenBatch, TokensLike, as_batch

__all__ = ["Model", "ModelNotFound", "Tokenizer", "load_model", "resolve_model_path"]

BACKEND_NAMES = ("eager", "vllm", "vllm-static")


class ModelNotFound(FileNotFoundError):
    """The name is neither a local directory nor a model in the local Hugging Face cache."""


def resolve_model_path(name: str | os.PathLike) -> Path:
    """A local directory as is; a hub name through the local HF cache only (never the network)."""
    path = Path(os.fspath(name)).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFound(f"{str(path)!r} is a directory but has no config.json: pass a Hugging Face "
                                "model directory (config.json, weights, tokenizer files)")
        return path
    text = os.fspath(name)
    if path.exists():
        raise ModelNotFound(f"{text!r} is a file, not a model directory")
    if text.count("/") != 1 or text.startswith((".", "/", "~")):
        raise ModelNotFound(f"model {text!r} not found: it is not a local directory, nor a hub name "
                            "like 'Qwen/Qwen3-8B'")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        local = snapshot_download(text, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError, ValueError) as exc:
        from huggingface_hub.constants import HF_HUB_CACHE

        raise ModelNotFound(
            f"model {text!r} is not in the local Hugging Face cache ({HF_HUB_CACHE}) and this "
            f"library never downloads: fetch it first (e.g. `hf download {text}` on a machine with "
            f"network, then copy the cache), or pass a local model directory"
        ) from exc
    return Path(local)


class Tokenizer:
    """The model's tokenizer with the conversions this library uses."""

    def __init__(self, hf_tokenizer: Any, d_vocab: int) -> None:
        self.hf = hf_tokenizer
        self.d_vocab = d_vocab
        pad = hf_tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (hf_tokenizer.eos_token_id or 0))
        self.eos_id = hf_tokenizer.eos_token_id

    def to_tokens(self, text: str | Sequence[str]) -> torch.Tensor | TokenBatch:
        """A string -> ``[1, pos]`` int64 ids; a list of strings -> a right-padded TokenBatch
        (``ids``, ``attention_mask``) whose padded positions never reach results."""
        if isinstance(text, str):
            ids = self.hf(text, add_special_tokens=True)["input_ids"]
            if not ids:
                raise ValueError("empty prompt: the text tokenized to no tokens")
            return torch.tensor([ids], dtype=torch.long)
        if isinstance(text, (list, tuple)) and text and all(isinstance(t, str) for t in text):
            rows = [self.hf(t, add_special_tokens=True)["input_ids"] for t in text]
            return as_batch(rows, self.d_vocab, self.pad_id)
        raise TypeError("to_tokens takes a str or a non-empty list of str")

    def to_string(self, ids: Sequence[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def to_str_tokens(self, ids: Sequence[int] | torch.Tensor) -> list[str]:
        """Each id's own text (special tokens included), for labelling positions."""
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        return [self.hf.decode([int(i)], skip_special_tokens=False) for i in ids]

    def decode_stream(self):
        """A function ``id -> new text or None`` that decodes one token per call (the fast
        tokenizer's streaming decoder), or None where the tokenizer has none."""
        rust = getattr(self.hf, "_tokenizer", None)
        try:
            from tokenizers.decoders import DecodeStream
        except ImportError:  # an old tokenizers
            return None
        if rust is None:
            return None
        stream = DecodeStream(skip_special_tokens=True)
        return lambda token_id: stream.step(rust, token_id)


class Model:
    """A loaded model on one backend. Everything here but the generation methods answers
    from configuration, before any forward runs."""

    def __init__(self, name: str, path: Path, graph: ModelGraph, spec: Any, backend: Any,
                 tokenizer: Tokenizer, config: Any) -> None:
        self.name = name
        self.path = path
        self.graph = graph
        self.spec = spec
        self.backend = backend
        self.tok = tokenizer
        self.config = config

    # ---- facts ------------------------------------------------------------------
    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def n_layers(self) -> int:
        return self.graph.n_layers

    @property
    def d_model(self) -> int:
        return self.graph.d_model

    @property
    def d_vocab(self) -> int:
        return self.graph.d_vocab

    @property
    def residual_basis(self) -> ResidualBasis:
        return self.graph.residual_basis

    @property
    def hooks_available(self) -> bool:
        return bool(self.backend.hooks_available)

    @property
    def graph_replay(self) -> bool:
        return bool(self.backend.graph_replay)

    @property
    def static_points(self) -> tuple[Address, ...]:
        return tuple(self.backend.static_points)

    @property
    def static_writes(self) -> tuple[Address, ...]:
        return tuple(self.backend.static_writes)

    @property
    def max_model_len(self) -> int:
        """The context: prompt plus generated tokens never exceed it (generation stops there
        with finish_reason "length", on every backend)."""
        return int(self.backend.max_model_len)

    @property
    def grad_support(self) -> GradSupport:
        return self.backend.grad_support

    @property
    def dtype(self) -> torch.dtype:
        return self.backend.dtype

    @property
    def hf(self):
        """The underlying transformers model (eager backend only)."""
        if self.backend.name != "eager":
            raise AttributeError(
                f"model.hf is the transformers model of the eager backend; this model runs on "
                f"{self.backend.name!r}, whose modules live inside the engine (model.backend.module(path)), "
                f"or load it with backend='eager'")
        return self.backend.hf

    def points(self) -> tuple[PointSpec, ...]:
        """Every point this model has, including what its trunk adds (resid_streams)."""
        return self.graph.points()

    def to_tokens(self, text: str | Sequence[str]):
        return self.tok.to_tokens(text)

    def to_string(self, ids) -> str:
        return self.tok.to_string(ids)

    def to_str_tokens(self, tokens) -> list[str] | list[list[str]]:
        """The text of each token of one prompt (a string is tokenized first, with the BOS
        token where the tokenizer adds one), as TransformerLens's ``to_str_tokens``; a list of
        strings gives one such list per string."""
        if isinstance(tokens, (list, tuple)) and tokens and all(isinstance(t, str) for t in tokens):
            return [self.to_str_tokens(t) for t in tokens]
        if isinstance(tokens, str):
            tokens = self.to_tokens(tokens)
        batch = self.batch(tokens)
        if len(batch) != 1:
            raise ValueError(f"to_str_tokens takes one prompt, got a batch of {len(batch)}")
        return self.tok.to_str_tokens(batch.row(0))

    def batch(self, tokens: TokensLike) -> TokenBatch:
        return as_batch(tokens, self.graph.d_vocab, self.tok.pad_id)

    def embed(self, tokens: TokensLike) -> torch.Tensor:
        """The model's own input embeddings of one prompt, ``[pos, d_model]`` in the model dtype:
        what ``generate_from_embeds`` takes (Gemma 2's sqrt(d_model) scale included)."""
        batch = self.batch(tokens)
        if len(batch) != 1:
            raise ValueError(f"embed takes one prompt, got a batch of {len(batch)}")
        return self.backend.embed(batch.ids[0])

    def close(self) -> None:
        """Release the engine (a vLLM engine and its KV cache); other models keep working."""
        self.backend.close()

    def warmup(self) -> None:
        """Start the engine if it is started lazily (a no-op on eager)."""
        self.backend.warmup()

    def __repr__(self) -> str:
        return f"Model({self.name!r}, backend={self.backend.name!r}, {self.graph.describe()})"

    # The generation, lens and async methods are attached in _api (they need the transforms).


def load_model(name: str | os.PathLike, backend: str = "eager", *, requires_grad: bool = False,
               dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
               enable_prompt_embeds: bool = False, max_model_len: int | None = None,
               static_points: Any = None, static_writes: Any = None,
               **engine_kwargs: Any) -> Model:
    """Load a model directory, or a hub name from the local HF cache, on ``backend``
    ("eager", "vllm" or "vllm-static"). Switching backend is this argument and nothing else.
    ``static_points`` / ``static_writes`` (vllm-static only): the taps and steering sites compiled
    into vLLM's graph — "auto" (the default: resid_post, attn_out and mlp_out at every layer,
    steering at resid_post) or a list of addresses like "resid_post.3".
    ``max_model_len`` caps the context on every backend (default: the model's own);
    other keyword arguments go to ``vllm.LLM`` on vLLM, checked by name and type here."""
    from transformers import AutoConfig, AutoTokenizer

    from specs import spec_for_config

    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKEND_NAMES}")
    if requires_grad and backend != "eager":
        raise CapabilityUnsupported("gradients", backend)
    if backend != "vllm-static" and (static_points is not None or static_writes is not None):
        raise ValueError("static_points / static_writes declare what backend='vllm-static' compiles in; "
                         f"backend={backend!r} takes neither (hooks reach every served point)")
    if backend == "eager" and engine_kwargs:
        raise TypeError(f"unexpected arguments for backend='eager': {sorted(engine_kwargs)} "
                        "(engine arguments go to vLLM: use backend='vllm')")
    if not isinstance(requires_grad, bool):
        raise TypeError(f"requires_grad must be a bool, got {requires_grad!r}")
    path = resolve_model_path(name)
    config = AutoConfig.from_pretrained(path)
    spec = spec_for_config(config)
    graph = spec.graph_from_config(config)
    context = _context_length(config, max_model_len)
    torch_dtype = _dtype(dtype, config)
    if backend == "eager":
        from bridge.eager import load_eager

        engine = load_eager(path, spec, graph, dtype=torch_dtype, device=device,
                            requires_grad=requires_grad, max_model_len=context)
    else:
        if not spec.vllm:
            raise CapabilityUnsupported("vllm_architecture", backend,
                                        detail=f"{spec.arch}: {spec.vllm_note}")
        if torch_dtype == torch.float16:  # vLLM refuses these only at the first request, as a raw pydantic error
            from vllm.config.model import _FLOAT16_NOT_SUPPORTED_MODELS

            why = _FLOAT16_NOT_SUPPORTED_MODELS.get(getattr(config, "model_type", None))
            if why:
                raise CapabilityUnsupported("float16", backend, why=f"vLLM refuses {config.model_type} in "
                                            f"float16: {why}", instead="load with dtype='bfloat16' or 'float32'")
        from bridge.vllm import VllmBackend

        if backend == "vllm-static":
            from bridge.vllm.static import VllmStaticBackend

            engine = VllmStaticBackend(path, spec, graph, dtype=torch_dtype, max_model_len=context,
                                       enable_prompt_embeds=enable_prompt_embeds, static_points=static_points,
                                       static_writes=static_writes, **engine_kwargs)
        else:
            engine = VllmBackend(path, spec, graph, dtype=torch_dtype, max_model_len=context,
                                 enable_prompt_embeds=enable_prompt_embeds, **engine_kwargs)
    hf_tok = AutoTokenizer.from_pretrained(path)
    tokenizer = Tokenizer(hf_tok, graph.d_vocab)
    return Model(os.fspath(name), path, graph, spec, engine, tokenizer, config)


def _context_length(config, requested) -> int:
    """The model's context: its config's, or a smaller ``max_model_len`` the caller asks for."""
    native = None
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            native = value
            break
    if requested is None:
        if native is None:
            raise ValueError("this model's config names no context length (max_position_embeddings): "
                             "pass max_model_len=")
        return native
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise TypeError(f"max_model_len must be a positive int, got {requested!r}")
    if native is not None and requested > native:
        raise ValueError(f"max_model_len={requested} is above this model's context "
                         f"(max_position_embeddings={native}): pass at most {native}")
    return requested


def _dtype(dtype, config) -> torch.dtype:
    if dtype is None:
        dtype = "auto"
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16, "auto": None}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(table)} or a torch.dtype")
    if table[dtype] is None:
        got = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
        if isinstance(got, torch.dtype):
            return got
        got = str(got).replace("torch.", "")
        return _dtype(got if got != "auto" else "float32", config)
    return table[dtype]
