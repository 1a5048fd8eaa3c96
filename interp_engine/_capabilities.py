"""What each backend can and cannot do, as data, and the error raised when work is refused."""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["CAPABILITIES", "Capability", "CapabilityUnsupported"]


@dataclass(frozen=True)
class Capability:
    """A capability some backend lacks: why, what to call instead, and who serves it."""

    name: str
    why: str
    instead: str
    backends: frozenset[str]

    def served_by(self, backend: str) -> bool:
        return backend in self.backends


class CapabilityUnsupported(RuntimeError):
    """Raised before any forward when a backend cannot serve what was asked."""

    def __init__(self, capability: str, backend: str, why: str | None = None,
                 instead: str | None = None, detail: str | None = None) -> None:
        entry = CAPABILITIES.get(capability)
        self.capability = capability
        self.backend = backend
        self.why = why if why is not None else (entry.why if entry else "not supported")
        self.instead = instead if instead is not None else (entry.instead if entry else "")
        self.detail = detail
        if entry is not None and (entry.served_by(backend) or backend == "any"):  # the model lacks it
            message = f"{capability} does not apply to this model (backend {backend!r})"
        else:
            message = f"{capability} is not supported on backend {backend!r}"
        if detail:
            message += f" ({detail})"
        message += f": {self.why}"
        if self.instead:
            message += f". Instead: {self.instead}"
        super().__init__(message)


_ALL = frozenset({"eager", "vllm", "vllm-static"})
_EAGER = frozenset({"eager"})
_HOOKS = frozenset({"eager", "vllm"})


def _c(name: str, why: str, instead: str, backends: frozenset[str]) -> Capability:
    return Capability(name, why, instead, backends)


CAPABILITIES = MappingProxyType(
    {
        c.name: c
        for c in (
            _c("batched_prompts",
               "vLLM schedules each prompt as its own request at its true length, so a padded "
               "batch has no meaning there",
               "call once per prompt, or load the model with backend='eager'", _EAGER),
            _c("gradients",
               "vLLM runs under inference mode with fused kernels that have no backward",
               "load_model(..., backend='eager', requires_grad=True) and run_with_cache(..., detach=False)",
               _EAGER),
            _c("sequential_block",
               "in a parallel block (GPT-NeoX, Pythia) attention and the MLP both read resid_pre "
               "and their outputs are added together, so no residual stream lies between them",
               "capture resid_pre, attn_out and mlp_out (resid_post = resid_pre + attn_out + "
               "mlp_out)", _ALL),
            _c("attention_internals",
               "vLLM computes q, k and v in one fused qkv projection; its hook runtime reads them "
               "as parts of that output (after the per-head q/k norms where the model has them, "
               "before rotary embedding, as eager defines them), which needs the whole projection "
               "on one rank (tensor_parallel_size=1); vllm-static compiles residual-width taps only",
               "use backend='vllm' with tensor_parallel_size=1, or backend='eager'", _HOOKS),
            _c("attention_pattern",
               "vLLM's paged attention kernels never form the attention probability matrix; its "
               "hook runtime rebuilds it from the queries and keys each attention kernel receives "
               "(after rotary embedding) with that kernel's own scale, sliding window, soft-cap "
               "and sinks, which needs every head on one rank (tensor_parallel_size=1); "
               "vllm-static compiles residual-width taps only",
               "use backend='vllm' with tensor_parallel_size=1, or backend='eager'", _HOOKS),
            _c("mlp_internals",
               "vLLM computes the gate and up projections in one fused gate_up projection; its "
               "hook runtime reads mlp_pre as the gate part of that output and mlp_act at "
               "down_proj's input, which needs the whole projection on one rank for mlp_pre "
               "(tensor_parallel_size=1); vllm-static compiles residual-width taps only",
               "use backend='vllm' with tensor_parallel_size=1, or backend='eager'", _HOOKS),
            _c("expert_selection",
               "vLLM selects and weights experts inside its fused MoE kernel and never returns "
               "the selection; the vLLM backend recomputes it from router_logits only where the "
               "architecture's spec declares its routing rule and vLLM's router follows that rule",
               "capture 'router_logits' (served on vLLM) and call expert_assignment(..., top_k=k), "
               "or use backend='eager'", _EAGER),
            _c("expert_writes",
               "an experts= write zeroes or scales the routing weights the block's experts "
               "receive; vLLM's hook runtime reaches them where its fused MoE takes the router's "
               "selection (checked per layer when the engine starts), vllm-static compiles "
               "residual-width sites only",
               "use backend='vllm' or backend='eager' for experts= writes, or write the block's "
               "sum at mlp_out", _HOOKS),
            _c("parallel_residual_streams",
               "only DeepSeek-V4's hyper-connection trunk carries parallel residual streams, and "
               "vLLM has no CPU path for it",
               "use backend='eager'", _EAGER),
            _c("logits_in_stream",
               "vLLM's sampler never ships the logits tensor out of the worker, and vLLM computes "
               "logits only at each request's final position",
               "return_logits='last' (the final position's logits, served on vLLM by its own head "
               "in the worker), or ask for n_logprobs=k, which every backend honours", _EAGER),
            _c("free_decode_residuals",
               "the free decode_residuals reads the weights directly, which live inside the "
               "vLLM worker",
               "call model.decode_residuals(cache), which runs where the weights are", _EAGER),
            _c("logit_lens",
               "the residual basis is not a single additive stream read by the final norm "
               "(DeepSeek-V4 mixes several parallel streams before the head), so decoding an "
               "intermediate residual has no meaning",
               "read resid_streams and the model's own logits, or use a model whose "
               "residual_basis.lens_valid is true", _ALL),
            _c("vllm_architecture",
               "this vLLM build has no working path for this architecture on this device",
               "use backend='eager'", _EAGER),
            _c("static_graph",
               "hooks added to a compiled or graph-captured vLLM model never fire: only "
               "backend='vllm-static' compiles its taps into the graph",
               "use backend='vllm-static', or leave enforce_eager on with backend='vllm'",
               frozenset({"vllm-static"})),
            _c("static_point",
               "only residual-width points (resid_pre, resid_mid, resid_post, attn_out, mlp_out) "
               "compile into vLLM's graph as taps, one steering op per site and request",
               "use backend='vllm' (hooks on an eager vLLM engine) or backend='eager'",
               frozenset({"eager", "vllm"})),
            _c("undeclared_static_point",
               "backend='vllm-static' serves only the taps and steering sites declared when the "
               "model was loaded (they are compiled into the graph)",
               "declare it: load_model(..., backend='vllm-static', static_points=[...], "
               "static_writes=[...]), or use backend='vllm'",
               frozenset({"eager", "vllm"})),
        )
    }
)
