"""The eager bridge: lower Plans onto forward hooks of a Hugging Face transformers model.

Hooks are registered for one forward call and removed in ``finally``; concurrent generations
on one model interleave whole forwards under a lock, each with its own hooks, so they never
see each other's steering. The attention kernel is chosen per forward from the plan: the
model's fast default (SDPA) unless the plan reads ``pattern`` (only the eager kernel forms the
probabilities) or the architecture needs the eager kernel (Gemma 2's soft-capping).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable, Iterator

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from interp_engine._address import Address
from interp_engine._backend import RawStep
from interp_engine._graph import GradSupport, ModelGraph
from interp_engine._capabilities import CapabilityUnsupported
from interp_engine._ops import apply_write, expert_factor, reshape_point, select_rows, weight_experts
from interp_engine._plan import Plan, SteerOp, unit_count
from interp_engine._sampler import new_generator, sample_token
from interp_engine._sampling import SamplingConfig
from interp_engine._tokens import TokenBatch
from specs import ArchSpec, Tap

from ._hooks import ForwardWindow, HookSet
from .outputs import full_output

__all__ = ["EagerBackend", "load_eager"]


def load_eager(path, spec: ArchSpec, graph: ModelGraph, *, dtype: torch.dtype, device,
               requires_grad: bool, max_model_len: int) -> "EagerBackend":
    """Load the transformers model with its fast default attention kernel (or the eager one
    where the architecture needs it) and wrap it."""
    from transformers import AutoModelForCausalLM

    kwargs = {"attn_implementation": "eager"} if spec.eager_attention_only else {}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs).to(device)
    hf.eval()
    hf.requires_grad_(requires_grad)
    return EagerBackend(hf, spec, graph, requires_grad, max_model_len)


@dataclass
class _Captures:
    """Per-forward raw tensors for each (module path, how), plus each forward's window."""

    sinks: dict[tuple[str, str], list[torch.Tensor]] = field(default_factory=dict)
    windows: list[ForwardWindow] = field(default_factory=list)
    batch: int = 1


class EagerBackend:
    name = "eager"
    hooks_available = True
    graph_replay = False
    static_points: tuple[Address, ...] = ()
    static_writes: tuple[Address, ...] = ()
    prompt_embeds = True

    def __init__(self, hf_model: nn.Module, spec: ArchSpec, graph: ModelGraph, requires_grad: bool,
                 max_model_len: int) -> None:
        self.hf = hf_model
        self.spec = spec
        self.graph = graph
        self.requires_grad = requires_grad
        self.max_model_len = max_model_len
        self._modules: dict[str, nn.Module] = {}
        self._keys: dict[Address, tuple[str, str]] = {}
        self._lock = threading.RLock()
        first = next(hf_model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.eos_ids = _eos_ids(hf_model)
        self.attention = hf_model.config._attn_implementation  # the kernel it was loaded with

    # ---- capabilities -----------------------------------------------------------
    @property
    def grad_support(self) -> GradSupport:
        if self.requires_grad:
            return GradSupport(True, True, "eager", "loaded with requires_grad=True")
        return GradSupport(True, False, "eager",
                           "parameters are frozen (load with requires_grad=True for parameter "
                           "gradients); run_with_cache(..., detach=False) still records the forward "
                           "from the embeddings on, so gradients reach every captured tensor")

    def refusal(self, plan: Plan, batch: TokenBatch | None, *, gradients: bool = False):
        """Nothing in a valid plan is refused on eager, except a patch whose source holds a
        different number of prompts than the run, and an expert write on an architecture whose
        router does not return its weights and indices together."""
        for op in plan.writes:
            if op.experts is not None and self._router_outputs(op.address.layer) is None:
                return CapabilityUnsupported(
                    "expert_writes", "eager", detail=f"experts={list(op.experts)} at {op.address}",
                    why=f"this {self.graph.arch} spec's router does not return its routing weights and "
                        "their experts' indices from one module",
                    instead="write the block's sum at mlp_out without experts=")
            if op.batched:
                rows = op._vector.shape[0]
                if batch is not None and len(batch) != rows:
                    return _batched_patch(op, f"a run of {len(batch)} prompts")
        return None

    # ---- harvest: batched forwards here, no workers to write rows into a file -------
    def sinks(self, plan: Plan) -> bool:
        return False

    def harvest_into(self, windows: list[list[int]], plan: Plan, max_tokens: int, in_flight: int, path: str,
                     offsets: Callable[[int], dict[str, int]], positions: int) -> Iterator:
        raise CapabilityUnsupported("harvest_sink", self.name, why="the eager backend runs its forwards in "
                                    "this process: no worker writes rows into a file",
                                    instead="harvest(model, ...) batches eager forwards itself")

    # ---- lowering ---------------------------------------------------------------
    def module(self, path: str) -> nn.Module:
        module = self._modules.get(path)
        if module is None:
            module = self.hf.get_submodule(path)
            self._modules[path] = module
        return module

    def _tap(self, name: str) -> Tap:
        return self.spec.eager[name]

    def _router_outputs(self, layer: int) -> tuple[str, int, int] | None:
        """(router module path, index of its weights output, of its indices output), or None
        where the spec's expert_weights / expert_indices are not two outputs of one module."""
        weights, indices = self.spec.eager.get("expert_weights"), self.spec.eager.get("expert_indices")
        if weights is None or indices is None:
            return None
        path = weights.module_path(layer)
        if (indices.module_path(layer) != path or not weights.how.startswith("out")
                or not indices.how.startswith("out") or weights.how == "out" or indices.how == "out"):
            return None
        return path, int(weights.how[3:]), int(indices.how[3:])

    def _read_key(self, address: Address) -> tuple[str, str]:
        """(module path, how) of an address, resolved once per address."""
        key = self._keys.get(address)
        if key is None:
            tap = self._tap(address.name)
            key = self._keys[address] = (tap.module_path(address.layer), tap.how)
        return key

    def _lower(self, plan: Plan, window: ForwardWindow, captures: _Captures | None) -> HookSet:
        hooks = HookSet()
        try:
            # Order on a shared module: writes at a point, then reads of it (a capture sees the
            # steered value), then resid_mid writes, which ride on the attn_out module but come
            # after attention's output in the layer (attn_out reads never see them).
            # Expert writes come last on the router: its captures (router_logits, expert_weights,
            # expert_indices) show the router's own choice, as on vLLM, and the experts receive
            # the written weights.
            pre_sinks: dict[int, list] = {}
            mid_writes, expert_writes = [], []
            positions = window.positions() if plan.writes else None
            for op in plan.writes:
                sel = select_rows(op.positions, op.per_position, positions, window.prompt_end)
                if sel.empty:
                    continue
                if op.experts is not None:
                    expert_writes.append((op, sel))
                elif op.address.name == "resid_mid":
                    mid_writes.append((op, sel))
                else:
                    self._lower_write(hooks, op, sel, pre_sinks)
            if captures is not None:
                seen: set[tuple[str, str]] = set()
                for address in plan.reads:
                    key = self._read_key(address)
                    if key in seen:
                        continue  # another address shares this tensor
                    seen.add(key)
                    sink = captures.sinks.setdefault(key, [])
                    hooks.read(self.module(key[0]), key[1], sink)
            for op, sel in mid_writes:
                self._lower_write(hooks, op, sel, pre_sinks)
            for op, sel in expert_writes:
                self._lower_expert_write(hooks, op, sel, window.length)
        except BaseException:
            hooks.remove()
            raise
        return hooks

    def _lower_write(self, hooks: HookSet, op: SteerOp, sel, pre_sinks: dict) -> None:
        vec = op.placed(self.device, self.dtype)  # made once per op, not per step
        kind, layer = op.op, op.address.layer
        if op.address.name == "resid_mid":
            # resid_mid = resid_pre + attn_out: write attn_out so that the sum takes the op.
            tap = self._tap("attn_out")
            if kind == "add":
                hooks.write(self.module(tap.module_path(layer)), tap.how,
                            lambda x: apply_write("add", x, vec, sel))
                return
            sink = pre_sinks.get(layer)
            if sink is None:
                sink = pre_sinks[layer] = []
                layer_tap = self._tap("resid_pre")
                hooks.read(self.module(layer_tap.module_path(layer)), "in", sink)
            hooks.write(self.module(tap.module_path(layer)), tap.how,
                        lambda x, sink=sink: apply_write(kind, x, vec, sel, base=sink[-1]))
            return
        tap = self._tap(op.address.name)
        cols = self._columns(op, tap)

        heads_first = tap.post == "heads_first"

        def write(x):
            if x.dim() == 3:
                return apply_write(kind, x, vec, sel, cols=cols)
            # already split per head: [batch, pos, heads, d_head] (Qwen3's q_norm) or
            # [batch, heads, pos, d_head] (Gemma 3's); written as one row per position
            rows = x.transpose(1, 2) if heads_first else x
            new = apply_write(kind, rows.flatten(2), vec, sel, cols=cols).view(rows.shape)
            return new.transpose(1, 2) if heads_first else new
        hooks.write(self.module(tap.module_path(layer)), tap.how, write)

    def _lower_expert_write(self, hooks: HookSet, op: SteerOp, sel, length: int) -> None:
        """Zero or scale the routing weights the block's experts receive for ``op.experts``."""
        path, wi, ii = self._router_outputs(op.address.layer)
        experts = torch.tensor(op.experts, device=self.device)
        factor = expert_factor(op.op, op.scale)

        def rewrite(out):
            weights, indices = out[wi], out[ii]  # [batch * pos, top_k]
            top_k = weights.shape[-1]
            new = weight_experts(weights.reshape(-1, length, top_k), indices.reshape(-1, length, top_k),
                                 experts, factor, sel).reshape(weights.shape)
            return out[:wi] + (new,) + out[wi + 1:]
        hooks.rewrite(self.module(path), rewrite)

    def _columns(self, op: SteerOp, tap: Tap) -> torch.Tensor | None:
        """The columns of the hooked tensor an op writes: its selected heads or neurons, placed
        inside their part of a fused output (GPT-2's c_attn, Phi-3's gate_up_proj)."""
        cols = op.column_index
        if tap.split is None:
            return None if cols is None else cols.to(self.device)
        return torch.tensor(tap.split.columns(self.graph, op.columns), device=self.device)

    # ---- running ----------------------------------------------------------------
    @contextlib.contextmanager
    def _kernel_for(self, plan: Plan):
        """The eager attention kernel while a plan that reads ``pattern`` runs."""
        config = self.hf.config
        if self.attention == "eager" or not any(a.name == "pattern" for a in plan.reads):
            yield
            return
        config._attn_implementation = "eager"
        try:
            yield
        finally:
            config._attn_implementation = self.attention

    @contextlib.contextmanager
    def _grad_mode(self, detach: bool):
        """No autograd for a detached run. Otherwise record it, also on frozen parameters: the
        embeddings are made to require grad, so every captured tensor has a graph to its input."""
        if detach:
            with torch.no_grad():
                yield
            return
        if self.requires_grad:
            yield
            return

        def track(module, args, out):
            return out if out.requires_grad else out.detach().requires_grad_(True)
        handle = self.hf.get_input_embeddings().register_forward_hook(track)
        try:
            with torch.enable_grad():
                yield
        finally:
            handle.remove()

    @contextlib.contextmanager
    def _stop_at(self, layer: int | None):
        """TransformerLens's stop_at_layer: the forward ends as it reaches layer ``layer`` (the
        final norm when ``layer`` is n_layers), after every hook of the layers before it ran."""
        if layer is None:
            yield
            return
        path = (self.spec.eager["resid_pre"].module_path(layer) if layer < self.graph.n_layers
                else self.spec.final_norm_path)

        def stop(module, args):
            raise _Stopped
        handle = self.module(path).register_forward_pre_hook(stop)
        try:
            yield
        finally:
            handle.remove()

    def forward(self, plan: Plan, window: ForwardWindow, captures: _Captures | None, detach: bool,
                stop_at_layer: int | None = None, **inputs):
        with self._lock:
            hooks = self._lower(plan, window, captures)
            with hooks.active(), self._kernel_for(plan), self._grad_mode(detach), self._stop_at(stop_at_layer):
                try:
                    out = self.hf(**inputs)
                except _Stopped:
                    out = None
            if captures is not None:
                captures.windows.append(window)
            return out

    def run_with_cache(self, plan: Plan, batch: TokenBatch, detach: bool = True,
                       want_logits: bool | str = False, stop_at_layer: int | None = None):
        ids = batch.ids.to(self.device)
        inputs = {"input_ids": ids, "use_cache": False}
        if batch.padded:
            inputs["attention_mask"] = batch.attention_mask.to(self.device)
        if not want_logits or (want_logits == "last" and not batch.padded):
            inputs["logits_to_keep"] = 1
        captures = _Captures(batch=len(batch))
        window = ForwardWindow(0, ids.shape[1], None)
        out = self.forward(plan, window, captures, detach, stop_at_layer, **inputs)
        values = self.assemble(plan, captures)
        logits = out.logits if want_logits and out is not None else None
        mask = batch.attention_mask.to(self.device).bool() if batch.padded else None
        if mask is not None:
            values = {a: _zero_pads(a, t, mask) for a, t in values.items()}
        if want_logits == "last":  # each row's final real position: [batch, d_vocab]
            if mask is None:
                return values, logits[:, -1]
            last = (mask.long() * torch.arange(mask.shape[1], device=self.device)).argmax(-1)
            return values, logits[torch.arange(len(batch), device=self.device), last]
        if logits is not None and mask is not None:
            logits = logits.masked_fill(~mask[..., None], 0.0)
        return values, logits

    def assemble(self, plan: Plan, captures: _Captures) -> dict[Address, torch.Tensor]:
        """Turn raw per-forward tensors into ``[batch, pos, ...]`` per Address."""
        b = captures.batch
        values: dict[Address, torch.Tensor] = {}
        total = sum(w.length for w in captures.windows)
        for address in plan.reads:
            tap = self._tap(address.name)
            raw = captures.sinks[self._read_key(address)]
            pieces = []
            for t, w in zip(raw, captures.windows):
                if tap.split is not None:  # one part of a fused output (qkv_proj, gate_up_proj)
                    t = tap.split.take(t, self.graph)
                t = reshape_point(t, tap.post, self.graph, (b, w.length))
                if address.name == "pattern" and t.shape[-1] < total:
                    # Keys are the most recent ones up to this window's end (a sliding-window
                    # cache keeps fewer than all): place them at their absolute positions.
                    end = w.start + w.length
                    t = torch.nn.functional.pad(t, (end - t.shape[-1], total - end))
                if address.stream is not None:
                    t = t[:, :, address.stream]
                pieces.append(t)
            dim = 2 if address.name == "pattern" else 1
            values[address] = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
        return values

    # ---- generation -------------------------------------------------------------
    def generate(self, prompt: list[int] | None, config: SamplingConfig, plan: Plan,
                 capture: _Captures | None = None, embeds: torch.Tensor | None = None
                 ) -> Iterator[RawStep]:
        """Greedy or sampled decoding with the KV cache; one hooked forward per step."""
        from transformers import DynamicCache

        for op in plan.writes:
            if op.batched:
                raise _batched_patch(op, "a generation (one prompt)")

        if embeds is not None and "hash_moe" in (getattr(self.hf.config, "mlp_layer_types", None) or ()):
            raise ValueError(f"{self.graph.arch} routes its hash-MoE layers by token id, so it cannot "
                             "generate from prompt embeddings: pass token ids instead")
        # vLLM's per-request generator and draw (interp_engine._sampler): a seed gives the
        # tokens a vLLM engine on CPU draws; no seed leaves the global RNG alone.
        generator = None if config.greedy else new_generator(config.seed)
        stops = frozenset(config.stop_token_ids) | (self.eos_ids if config.stop_at_eos else frozenset())
        banned = torch.tensor(sorted(stops), dtype=torch.long) if config.min_tokens and stops else None
        past = DynamicCache(config=self.hf.config)
        prompt_len = len(prompt) if prompt is not None else int(embeds.shape[0])
        if embeds is not None:
            inputs = {"inputs_embeds": embeds.to(self.device, self.dtype).unsqueeze(0)}
        else:
            inputs = {"input_ids": torch.tensor([prompt], dtype=torch.long, device=self.device)}
        start, length = 0, prompt_len
        for step in range(config.max_tokens):
            window = ForwardWindow(start, length, prompt_len)
            out = self.forward(plan, window, capture, True, past_key_values=past, use_cache=True,
                               logits_to_keep=1, **inputs)
            logits = out.logits[0, -1].float()
            scores = logits
            if banned is not None and step < config.min_tokens:  # as vLLM: stop tokens masked
                scores = logits.index_fill(0, banned, float("-inf"))
            token = sample_token(scores, config.temperature, generator, config.top_k, config.top_p, config.min_p)
            logprobs = sampled = None
            if config.n_logprobs is not None:  # raw logprobs, before any masking (vLLM's default)
                lp = torch.log_softmax(logits, dim=-1)
                values, ids = torch.topk(lp, config.n_logprobs)
                logprobs = [{"token_id": int(i), "logprob": float(v)}
                            for v, i in zip(values.tolist(), ids.tolist())]
                sampled = float(lp[token])
            finish = None
            if token in stops:
                finish = "stop"
            elif step == config.max_tokens - 1:
                finish = "length"
            yield RawStep(token, logprobs, logits, finish, sampled)
            if finish is not None:
                return
            start += length
            length = 1
            inputs = {"input_ids": torch.tensor([[token]], dtype=torch.long, device=self.device)}

    async def agenerate(self, prompt: list[int] | None, config: SamplingConfig, plan: Plan,
                        capture: _Captures | None = None, embeds: torch.Tensor | None = None,
                        streaming: bool = True) -> AsyncIterator[list[RawStep]]:
        """One forward per step, yielding to the event loop between steps so concurrent
        requests interleave; each forward holds its own hooks only while it runs. Each step is
        yielded as it is made (a list of one), ``streaming`` or not."""
        steps = self.generate(prompt, config, plan, capture, embeds=embeds)
        try:
            for raw in steps:
                yield [raw]
                await asyncio.sleep(0)
        finally:
            steps.close()

    def new_capture(self) -> _Captures:
        return _Captures(batch=1)

    def request_output(self, prompt_ids: list[int], steps: list, finish: str, n_logprobs: int | None):
        return full_output(prompt_ids, steps, finish, n_logprobs)

    def head_contributions(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """``z`` ``[batch, pos, n_heads, d_head]`` through each head's slice of o_proj."""
        proj = self.module(self._tap("z").module_path(layer))
        weight = proj.weight.T if isinstance(proj, Conv1D) else proj.weight  # Conv1D: [in, out]
        w = weight.reshape(weight.shape[0], self.graph.n_heads, self.graph.d_head)
        with torch.set_grad_enabled(z.requires_grad):
            return torch.einsum("bphd,mhd->bphm", z.to(weight.device, weight.dtype), w)

    # ---- lens -------------------------------------------------------------------
    def decode(self, resid: torch.Tensor) -> torch.Tensor:
        """Final norm, unembedding, and the architecture's soft-cap: raw logits."""
        norm = self.module(self.spec.final_norm_path)
        head = self.module(self.spec.unembed_path)
        with torch.set_grad_enabled(resid.requires_grad):
            logits = head(norm(resid.to(self.device, self.dtype)))
            cap = self.graph.final_logit_softcap
            if cap:
                logits = torch.tanh(logits / cap) * cap
        return logits

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.hf.get_input_embeddings()(ids.to(self.device))

    # ---- lifetime ---------------------------------------------------------------
    def warmup(self) -> None:
        """Nothing to start: the model is loaded."""

    def close(self) -> None:
        """Nothing to release beyond what garbage collection frees."""


def _batched_patch(op: SteerOp, got: str) -> ValueError:
    rows = op._vector.shape[0]
    return ValueError(f"the patch at {op.address} comes from a cache of {rows} prompts, so it patches "
                      f"a run of {rows} prompts row by row; this is {got}: patch from a one-prompt "
                      "cache, or run as many prompts with run_with_cache")


class _Stopped(Exception):
    """Ends an eager forward at stop_at_layer (raised by a pre-hook, caught in forward)."""


def _zero_pads(address: Address, t: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    if address.name == "pattern":
        m = mask[:, None, :, None] & mask[:, None, None, :]
    else:
        m = mask.reshape(mask.shape + (1,) * (t.dim() - 2))
    return t.masked_fill(~m, 0)


def _eos_ids(hf_model: nn.Module) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(hf_model, "generation_config", None), hf_model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
