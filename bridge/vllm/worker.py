"""What vLLM mixes into each worker (``worker_extension_cls``): a few methods a client reaches
through ``collective_rpc``. Everything crosses as plain data (wire tensors), so the same calls
work in process, across processes, and on Ray workers on other machines.
"""

from __future__ import annotations

from typing import Any

import torch

from .install import install_runtime, runtime_of, tp_rank_and_size
from .plugin import register
from .spill import as_rows, encode
from .wire import tensor_from_wire, tensor_to_wire

# vLLM imports this module in each worker process before it builds the worker: from here on the
# runtime is installed as soon as the model is loaded (before any profiling or compilation).
register()

__all__ = ["InterpWorkerExtension", "install_runtime", "runtime_of"]  # the latter two re-exported


def _routing_mismatch(runtime) -> dict[str, str]:
    """MoE layers where vLLM's router does not follow the spec's rule, with why (see routing.py)."""
    from .routing import mismatches

    hf_config = runtime.runner.model_config.hf_config
    layers = list(runtime.spec.graph_from_config(hf_config).moe_layers) if runtime.routing else []
    return {str(layer): why for layer, why in mismatches(runtime.root, runtime.spec, runtime.routing,
                                                          layers).items()}


def _expert_write_refusals(runtime) -> dict[str, str]:
    """MoE layers where an experts= write cannot be served, with why (see routing.py)."""
    from .routing import expert_write_refusals

    layers = list(runtime.graph.moe_layers)
    return {str(layer): why for layer, why in expert_write_refusals(runtime.root, runtime.spec, layers).items()}


def _pattern_mismatch(runtime) -> dict[str, str]:
    """Layers whose attention kernel the pattern cannot be rebuilt for, with why (attention.py)."""
    from .attention import mismatches

    layers = list(range(runtime.graph.n_layers))
    return {str(layer): why for layer, why in mismatches(runtime.root, runtime.spec, layers).items()}


def _own_rows(value: torch.Tensor) -> torch.Tensor:
    """Rows in memory of their own (the buffers they view are let go with the request)."""
    return value.detach().to("cpu", copy=True)


class InterpWorkerExtension:
    """Mixed into vLLM's worker class; ``self`` is the worker."""

    def _interp_runtime(self):
        return runtime_of(self.model_runner)

    def interp_install(self) -> dict:
        runtime = install_runtime(self.model_runner)
        rank, world = tp_rank_and_size()
        return {"rank": rank, "world": world, "routing_mismatch": _routing_mismatch(runtime),
                "pattern_mismatch": _pattern_mismatch(runtime),
                "expert_write_refusals": _expert_write_refusals(runtime)}

    def interp_collect(self, rid: str, n_positions: int | None, release: bool = True) -> dict:
        out = self._interp_runtime().collect(rid, n_positions, release)
        out["rank"] = tp_rank_and_size()[0]
        return out

    def interp_collect_many(self, items: list, spill_to: str | None = None, tensors: bool = False) -> list[dict]:
        """``interp_collect`` of several ``(rid, n_positions)`` at once (each released): the
        driver collects every request that finished in one step with one rpc. ``spill_to``:
        the base path of the client's rows files (spill.py), where this rank writes the rows.
        ``tensors``: the client runs in this process (an in-process engine, whose rpc answer is
        never serialized): each point's rows come as a tensor of their own, not as bytes."""
        runtime, rank = self._interp_runtime(), tp_rank_and_size()[0]
        answers = []
        for rid, n_positions in items:
            # the rows as tensors for now (views of buffers let go: nothing writes them before
            # the next step), into the rows file or onto the wire below
            out = runtime.collect(rid, n_positions, True, encode=_own_rows if tensors else as_rows)
            out["rank"] = rank
            answers.append(out)
        if not tensors:
            encode(answers, None if not spill_to else f"{spill_to}.{rank}")
        return answers

    def interp_release(self, rid: str) -> None:
        self._interp_runtime().release(rid)

    def interp_flush(self, rid: str) -> bool:
        return self._interp_runtime().flush(rid)

    def interp_stats(self) -> dict:
        return self._interp_runtime().stats()

    def interp_static_info(self) -> dict:
        from .static_worker import static_info

        return static_info(self._interp_runtime())

    # ---- where the weights are ---------------------------------------------------------
    def _interp_root(self):
        return self.model_runner.model

    def interp_decode(self, resid) -> Any:
        """Final norm, then vLLM's own logits (lm head, soft-cap, gather across ranks)."""
        runtime = self._interp_runtime()
        root = self._interp_root()
        x = tensor_from_wire(resid)
        shape = x.shape
        with torch.inference_mode(), runtime.off_step():
            flat = x.reshape(-1, shape[-1]).to(runtime.device, runtime.dtype)
            norm = root.get_submodule(runtime.spec.vllm_final_norm_path)
            logits = root.compute_logits(norm(flat))
        if logits is None:  # a rank the logits were not gathered to
            return None
        return tensor_to_wire(logits.reshape(*shape[:-1], logits.shape[-1]))

    def interp_heads(self, layer: int, z) -> Any:
        """Each head's write through vLLM's own o_proj (one head kept at a time), so that no
        weight is read as a matrix (CPU kernels repack them; tensor parallelism shards them)."""
        runtime = self._interp_runtime()
        root = self._interp_root()
        rank, world = tp_rank_and_size()
        o_proj = root.get_submodule(runtime.spec.vllm["z"].module_path(layer))
        full = tensor_from_wire(z)  # [b, p, n_heads, d_head]
        b, p, h, d = full.shape
        mine = h // world  # this rank's heads
        local = full[:, :, rank * mine:(rank + 1) * mine].reshape(b * p, mine * d)
        local = local.to(runtime.device, runtime.dtype)

        def run(x):
            out = o_proj(x)
            return out[0] if isinstance(out, tuple) else out

        heads = []
        with torch.inference_mode(), runtime.off_step():
            base = run(torch.zeros_like(local[:1]))
            for head in range(h):  # every rank runs every head (the all-reduce is collective)
                masked = torch.zeros_like(local)
                owner, j = divmod(head, mine)
                if owner == rank:
                    masked[:, j * d:(j + 1) * d] = local[:, j * d:(j + 1) * d]
                heads.append(run(masked) - base)
        return tensor_to_wire(torch.stack(heads, dim=1).reshape(b, p, h, -1)) if rank == 0 else None

    def interp_embed(self, ids: list[int]) -> Any:
        root = self._interp_root()
        runtime = self._interp_runtime()
        with torch.inference_mode(), runtime.off_step():
            out = root.embed_input_ids(torch.tensor(ids, dtype=torch.long, device=runtime.device))
        return tensor_to_wire(out) if tp_rank_and_size()[0] == 0 else None
