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
        return tuple(getattr(self.backend, "static_points", ()))

    @property
    def static_writes(self) -> tuple[Address, ...]:
        return tuple(getattr(self.backend, "static_writes", ()))

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
        getattr(self.backend, "close", lambda: None)()

    def warmup(self) -> None:
        """Start the engine if it is started lazily (a no-op on eager)."""
        getattr(self.backend, "warmup", lambda: None)()

    def __repr__(self) -> str:
        return f"Model({self.name!r}, backend={self.backend.name!r}, {self.graph.describe()})"

    # The generation, lens and async methods are attached in _api (they need the transforms).


def load_model(name: str | os.PathLike, backend: str = "eager", *, requires_grad: bool = False,
               dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu",
               enable_prompt_embeds: bool = False, static_points: Any = None,
               **engine_kwargs: Any) -> Model:
    """Load a model directory, or a hub name from the local HF cache, on ``backend``
    ("eager" or "vllm"). Switching backend is this argument and nothing else."""
    from transformers import AutoConfig, AutoTokenizer

    from specs import spec_for_config

    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown backend {backend!r}; use one of {BACKEND_NAMES}")
    if backend == "vllm-static":
        raise CapabilityUnsupported("static_graph", backend)
    if requires_grad and backend != "eager":
        raise CapabilityUnsupported("gradients", backend)
    if static_points is not None:
        raise CapabilityUnsupported("static_graph", backend,
                                    detail="static_points is only meaningful with backend='vllm-static'")
    path = resolve_model_path(name)
    config = AutoConfig.from_pretrained(path)
    spec = spec_for_config(config)
    graph = spec.graph_from_config(config)
    hf_tok = AutoTokenizer.from_pretrained(path)
    tokenizer = Tokenizer(hf_tok, graph.d_vocab)
    torch_dtype = _dtype(dtype, config)
    if backend == "eager":
        if engine_kwargs:
            raise TypeError(f"unexpected arguments for backend='eager': {sorted(engine_kwargs)}")
        from transformers import AutoModelForCausalLM

        from bridge.eager import EagerBackend

        # The eager attention kernel everywhere: SDPA silently drops attention-logit
        # soft-capping (Gemma 2), and only the eager kernel returns the pattern, whose capture
        # must not change the numbers.
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype,
                                                  attn_implementation="eager").to(device)
        hf.eval()
        hf.requires_grad_(requires_grad)
        engine = EagerBackend(hf, spec, graph, requires_grad)
        engine.prompt_embeds = True
    else:
        if not spec.vllm:
            raise CapabilityUnsupported("vllm_architecture", backend,
                                        detail=f"{spec.arch}: {spec.vllm_note}")
        from bridge.vllm import VllmBackend

        engine = VllmBackend(path, spec, graph, dtype=torch_dtype, tokenizer=hf_tok,
                             enable_prompt_embeds=enable_prompt_embeds, **engine_kwargs)
    return Model(os.fspath(name), path, graph, spec, engine, tokenizer, config)


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
