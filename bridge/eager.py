"""The eager bridge: lower Plans onto forward hooks of a Hugging Face transformers model.

Hooks are registered for one forward call and removed in ``finally``; concurrent generations
on one model interleave whole forwards under a lock, each with its own hooks, so they never
see each other's steering.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch import nn

from interp_engine._address import Address
from interp_engine._graph import GradSupport, ModelGraph
from interp_engine._plan import Plan, SteerOp
from interp_engine._sampling import SamplingConfig, sample_next
from interp_engine._tokens import TokenBatch
from specs import ArchSpec, Tap

from ._hooks import ForwardWindow, HookSet, apply_op, select_columns

__all__ = ["EagerBackend", "RawStep"]


@dataclass(frozen=True, eq=False)
class RawStep:
    """One generated token as a backend reports it."""

    token_id: int
    logprobs: list[dict] | None
    logits: torch.Tensor | None
    finish_reason: str | None  # None while generating; "stop" (EOS) or "length" on the last
    logprob: float | None = None  # of the sampled token, when logprobs were asked


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

    def __init__(self, hf_model: nn.Module, spec: ArchSpec, graph: ModelGraph, requires_grad: bool) -> None:
        self.hf = hf_model
        self.spec = spec
        self.graph = graph
        self.requires_grad = requires_grad
        self._modules: dict[str, nn.Module] = {}
        self._vectors: dict[int, tuple[SteerOp, torch.Tensor]] = {}
        self._keys: dict[Address, tuple[str, str]] = {}
        self._lock = threading.RLock()
        first = next(hf_model.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.eos_ids = _eos_ids(hf_model)

    # ---- capabilities -----------------------------------------------------------
    @property
    def grad_support(self) -> GradSupport:
        if self.requires_grad:
            return GradSupport(True, True, "eager", "loaded with requires_grad=True")
        return GradSupport(True, False, "eager",
                           "parameters are frozen; load with requires_grad=True for parameter gradients")

    def refusal(self, plan: Plan, batch: TokenBatch | None, *, gradients: bool = False):
        """Nothing in a valid plan is refused on eager."""
        return None

    # ---- lowering ---------------------------------------------------------------
    def module(self, path: str) -> nn.Module:
        module = self._modules.get(path)
        if module is None:
            module = self.hf.get_submodule(path)
            self._modules[path] = module
        return module

    def _tap(self, name: str) -> Tap:
        return self.spec.eager[name]

    def _read_key(self, address: Address) -> tuple[str, str]:
        """(module path, how) of an address, resolved once per address."""
        key = self._keys.get(address)
        if key is None:
            tap = self._tap(address.name)
            key = self._keys[address] = (tap.module_path(address.layer), tap.how)
        return key

    def _lower(self, plan: Plan, window: ForwardWindow, captures: _Captures | None, detach: bool) -> HookSet:
        hooks = HookSet()
        try:
            # Order on a shared module: writes at a point, then reads of it (a capture sees the
            # steered value), then resid_mid writes, which ride on the attn_out module but come
            # after attention's output in the layer (attn_out reads never see them).
            pre_sinks: dict[int, list] = {}
            mid_writes = []
            for op in plan.writes:
                cols, rows = select_columns(op, window)
                if cols == ():
                    continue
                if op.address.name == "resid_mid":
                    mid_writes.append((op, cols, rows))
                else:
                    self._lower_write(hooks, op, cols, rows, pre_sinks)
            if captures is not None:
                seen: set[tuple[str, str]] = set()
                for address in plan.reads:
                    key = self._read_key(address)
                    if key in seen:
                        continue  # another address shares this tensor
                    seen.add(key)
                    sink = captures.sinks.setdefault(key, [])
                    hooks.read(self.module(key[0]), key[1], sink)
            for op, cols, rows in mid_writes:
                self._lower_write(hooks, op, cols, rows, pre_sinks)
        except BaseException:
            hooks.remove()
            raise
        return hooks

    def _vector(self, op: SteerOp) -> torch.Tensor:
        """The op's effective vector on this device, computed once per op (not per step)."""
        entry = self._vectors.get(id(op))
        if entry is None or entry[0] is not op:
            if len(self._vectors) > 1024:
                self._vectors.clear()
            entry = (op, op.effective().to(self.device, self.dtype))
            self._vectors[id(op)] = entry
        return entry[1]

    def _lower_write(self, hooks: HookSet, op: SteerOp, cols, rows, pre_sinks: dict) -> None:
        vec = self._vector(op)
        kind, layer = op.op, op.address.layer
        if op.address.name == "resid_mid":
            tap = self._tap("attn_out")
            if kind == "add":
                hooks.write(self.module(tap.module_path(layer)), tap.how,
                            lambda x: apply_op("add", x, vec, cols, rows))
                return
            # resid_mid = resid_pre + attn_out: rewrite attn_out so the sum takes the new value.
            sink = pre_sinks.get(layer)
            if sink is None:
                sink = pre_sinks[layer] = []
                layer_tap = self._tap("resid_pre")
                hooks.read(self.module(layer_tap.module_path(layer)), "in", sink)

            def via_attn(x, sink=sink):
                pre = sink[-1]
                return apply_op(kind, pre + x, vec, cols, rows) - pre
            hooks.write(self.module(tap.module_path(layer)), tap.how, via_attn)
            return
        tap = self._tap(op.address.name)
        hooks.write(self.module(tap.module_path(layer)), tap.how,
                    lambda x: apply_op(kind, x, vec, cols, rows))

    # ---- running ----------------------------------------------------------------
    def _grad_context(self, detach: bool):
        return torch.no_grad() if detach else contextlib.nullcontext()

    def forward(self, plan: Plan, window: ForwardWindow, captures: _Captures | None, detach: bool,
                **inputs):
        with self._lock:
            hooks = self._lower(plan, window, captures, detach)
            with hooks.active(), self._grad_context(detach):
                out = self.hf(**inputs)
            if captures is not None:
                captures.windows.append(window)
            return out

    def run_with_cache(self, plan: Plan, batch: TokenBatch, detach: bool = True,
                       want_logits: bool = False):
        ids = batch.ids.to(self.device)
        inputs = {"input_ids": ids, "use_cache": False}
        if batch.padded:
            inputs["attention_mask"] = batch.attention_mask.to(self.device)
        if not want_logits:
            inputs["logits_to_keep"] = 1
        captures = _Captures(batch=len(batch))
        window = ForwardWindow(0, ids.shape[1], None)
        out = self.forward(plan, window, captures, detach, **inputs)
        values = self.assemble(plan, captures)
        logits = out.logits if want_logits else None
        if batch.padded:
            mask = batch.attention_mask.to(self.device).bool()
            values = {a: _zero_pads(a, t, mask) for a, t in values.items()}
            if logits is not None:
                logits = logits.masked_fill(~mask[..., None], 0.0)
        return values, logits

    def assemble(self, plan: Plan, captures: _Captures) -> dict[Address, torch.Tensor]:
        """Turn raw per-forward tensors into ``[batch, pos, ...]`` per Address."""
        graph, b = self.graph, captures.batch
        values: dict[Address, torch.Tensor] = {}
        total = sum(w.length for w in captures.windows)
        for address in plan.reads:
            tap = self._tap(address.name)
            raw = captures.sinks[self._read_key(address)]
            pieces = []
            for t, w in zip(raw, captures.windows):
                if tap.post == "heads":
                    t = t.reshape(b, w.length, graph.n_heads, graph.d_head)
                elif tap.post == "kv_heads":
                    t = t.reshape(b, w.length, graph.n_kv_heads, graph.d_head)
                elif tap.post == "flat":
                    t = t.reshape(b, w.length, -1)
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
                 captures: _Captures | None = None, embeds: torch.Tensor | None = None
                 ) -> Iterator[RawStep]:
        """Greedy or sampled decoding with the KV cache; one hooked forward per step."""
        from transformers import DynamicCache

        if embeds is not None and "hash_moe" in (getattr(self.hf.config, "mlp_layer_types", None) or ()):
            raise ValueError(f"{self.graph.arch} routes its hash-MoE layers by token id, so it cannot "
                             "generate from prompt embeddings: pass token ids instead")
        generator = None
        if not config.greedy:
            generator = torch.Generator(device="cpu")
            if config.seed is not None:
                generator.manual_seed(config.seed)
            else:
                generator.seed()  # non-deterministic, and the global RNG is left alone
        past = DynamicCache(config=self.hf.config)
        prompt_len = len(prompt) if prompt is not None else int(embeds.shape[0])
        if embeds is not None:
            inputs = {"inputs_embeds": embeds.to(self.device, self.dtype).unsqueeze(0)}
        else:
            inputs = {"input_ids": torch.tensor([prompt], dtype=torch.long, device=self.device)}
        start, length = 0, prompt_len
        for step in range(config.max_tokens):
            window = ForwardWindow(start, length, prompt_len)
            out = self.forward(plan, window, captures, True, past_key_values=past, use_cache=True,
                               logits_to_keep=1, **inputs)
            logits = out.logits[0, -1].float()
            token = sample_next(logits, config, generator)
            logprobs = sampled = None
            if config.n_logprobs is not None:
                lp = torch.log_softmax(logits, dim=-1)
                values, ids = torch.topk(lp, config.n_logprobs)
                logprobs = [{"token_id": int(i), "logprob": float(v)}
                            for v, i in zip(values.tolist(), ids.tolist())]
                sampled = float(lp[token])
            finish = None
            if config.stop_at_eos and token in self.eos_ids:
                finish = "stop"
            elif step == config.max_tokens - 1:
                finish = "length"
            yield RawStep(token, logprobs, logits, finish, sampled)
            if finish is not None:
                return
            start += length
            length = 1
            inputs = {"input_ids": torch.tensor([[token]], dtype=torch.long, device=self.device)}

    def new_capture(self) -> _Captures:
        return _Captures(batch=1)

    def head_contributions(self, layer: int, z: torch.Tensor) -> torch.Tensor:
        """``z`` ``[batch, pos, n_heads, d_head]`` through each head's slice of o_proj."""
        weight = self.module(self._tap("z").module_path(layer)).weight
        w = weight.reshape(weight.shape[0], self.graph.n_heads, self.graph.d_head)
        with self._grad_context(not z.requires_grad):
            return torch.einsum("bphd,mhd->bphm", z.to(weight.device, weight.dtype), w)

    # ---- lens -------------------------------------------------------------------
    def decode(self, resid: torch.Tensor) -> torch.Tensor:
        """Final norm, unembedding, and the architecture's soft-cap: raw logits."""
        norm = self.module(self.spec.final_norm_path)
        head = self.module(self.spec.unembed_path)
        with self._grad_context(not resid.requires_grad):
            logits = head(norm(resid.to(self.device, self.dtype)))
            cap = self.graph.final_logit_softcap
            if cap:
                logits = torch.tanh(logits / cap) * cap
        return logits

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.hf.get_input_embeddings()(ids.to(self.device))


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
