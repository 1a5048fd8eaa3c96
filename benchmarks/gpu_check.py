"""The vllm-static checks that need a GPU, prepared for when a GPU machine is lent (run through
``benchmarks/gpu_check.sh``; docs/vllm.md says how). On a GPU:

1. CUDA graphs are on: ``model.graph_replay`` is true and the engine's compilation config has a
   CUDA-graph mode other than NONE (the hook-based engine: false / eager).
2. Every declared point (resid_pre, resid_mid, resid_post, attn_out, mlp_out at every layer)
   equals the eager backend and the hook-based vLLM backend (fp32, 1e-5 scaled), on a prompt and
   while generating (prompt and generated positions).
3. Steering (add, ablate, set at a position, per-position add) gives the eager backend's greedy
   tokens and logprobs; concurrent requests that steer differently each get their own.
4. The in-place fused add+RMSNorm hazard: vLLM's CUDA ``fused_add_rms_norm`` rewrites the
   residual it is given, so a capture that kept a reference instead of copying inside the op
   would change later. Checked directly on the kernel (tap, run the kernel, the capture is
   unchanged and the kernel did change the residual) and end to end by (2): resid_mid and
   resid_post at every layer are exactly the tensors the next layer's kernel rewrites.
5. No recompile when vectors change, no graph breaks.

``--cpu``: the same checks here on CPU (graph_replay false, no CUDA-graph mode; the kernel check
uses vLLM's CPU kernel where it has one, else an in-place write), so the script is known to run
before a GPU is lent. Exit status 1 when any check fails; one line per check either way.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import traceback

import torch

NAMES = ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out")
PROMPTS = ("The capital of France is", "Once upon a time, in a land far away, there lived a café owner")
RESULTS: list[tuple[str, bool, str]] = []


def check(name: str):
    def wrap(fn):
        def run(*args):
            t0 = time.perf_counter()
            try:
                detail = fn(*args) or ""
                RESULTS.append((name, True, detail))
            except Exception as exc:  # every check runs; the summary says which failed
                traceback.print_exc()
                RESULTS.append((name, False, f"{type(exc).__name__}: {exc}"))
            print(f"[{'ok' if RESULTS[-1][1] else 'FAIL'}] {name} ({time.perf_counter() - t0:.1f} s) {RESULTS[-1][2]}",
                  flush=True)
        return run
    return wrap


@check("fused add+RMSNorm hazard: a tap copies inside the op")
def kernel_hazard(device: str) -> str:
    from bridge.vllm.static_ops import tap_fixed, tap_rows

    d, n = 128, 6
    g = torch.Generator().manual_seed(0)
    x, residual = (torch.randn(n, d, generator=g).to(device) for _ in range(2))
    weight = torch.rand(d, generator=g).to(device) + 0.5
    buf = torch.zeros(n + 1, d, device=device)
    want = (x + residual).cpu()
    if device == "cuda":  # the path a replayed CUDA graph runs
        tap_fixed(x, residual, buf, torch.arange(n, device=device))
    else:
        tap_rows(x, residual, buf, torch.arange(n), torch.tensor([n, 0]))  # (count: rows, not one prefix slice)
    before = residual.clone()
    try:
        import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

        torch.ops._C.fused_add_rms_norm(x, residual, weight, 1e-6)  # in place: residual += x, x = norm
        how = "vLLM's fused_add_rms_norm kernel"
    except (AttributeError, RuntimeError, NotImplementedError, ImportError):
        if device == "cuda":
            raise
        residual.add_(x)
        how = "an in-place add (no CPU fused kernel in this vLLM build)"
    assert not torch.equal(residual, before), "the kernel did not write its residual in place: check is void"
    assert torch.equal(buf[:n].cpu(), want), "a captured row changed after the in-place kernel"
    return how


def load(path, device: str):
    from interp_engine import load_model

    every = tuple(f"{n}.{layer}" for layer in range(3) for n in NAMES)
    kv = {"kv_cache_memory_bytes": 256 << 20}
    eager = load_model(path, device=device)
    hooks = load_model(path, backend="vllm", **kv)
    static = load_model(path, backend="vllm-static", static_points=every, static_writes=every, **kv)
    return eager, hooks, static


@check("CUDA graphs on for vllm-static (graph_replay, cudagraph_mode)")
def graphs(static, hooks, cpu: bool) -> str:
    from vllm.config import CUDAGraphMode

    mode = static.backend.engine_config().compilation_config.cudagraph_mode
    assert static.graph_replay is (not cpu), f"graph_replay {static.graph_replay} on {'CPU' if cpu else 'GPU'}"
    assert not hooks.graph_replay, "the hook-based engine claims graph replay"
    if not cpu:
        assert mode is not None and mode != CUDAGraphMode.NONE, f"cudagraph_mode {mode}"
    return f"graph_replay={static.graph_replay}, cudagraph_mode={mode}"


@check("declared points equal eager and hook vLLM (prompt)")
def points(eager, hooks, static) -> str:
    from interp_engine import run_with_cache
    from interp_engine.testing import assert_close_scaled

    declared = list(static.static_points)
    for prompt in PROMPTS:
        tokens = eager.to_tokens(prompt)
        ce, ch, cs = (run_with_cache(m, tokens, declared) for m in (eager, hooks, static))
        for a in declared:
            assert_close_scaled(cs[a].cpu(), ce[a].cpu(), msg=f"static vs eager {a}")
            assert_close_scaled(cs[a].cpu(), ch[a].cpu(), msg=f"static vs hooks {a}")
    return f"{len(declared)} points x {len(PROMPTS)} prompts"


@check("captures while generating equal eager (prompt and generated positions)")
def generation(eager, static) -> str:
    from interp_engine import capture_generation
    from interp_engine.testing import assert_close_scaled

    tokens = eager.to_tokens(PROMPTS[0])
    declared = list(static.static_points)
    ce_c, ce = capture_generation(eager, tokens, declared, max_tokens=7, temperature=0.0)
    cs_c, cs = capture_generation(static, tokens, declared, max_tokens=7, temperature=0.0)
    assert cs_c.token_ids == ce_c.token_ids, (cs_c.token_ids, ce_c.token_ids)
    for a in declared:
        assert cs[a].shape[1] == tokens.shape[1] + 6
        assert_close_scaled(cs[a].cpu(), ce[a].cpu(), msg=str(a))
    return f"{tokens.shape[1]} prompt + 6 generated positions"


def _specs(model):
    from interp_engine import SteerSpec

    g = torch.Generator().manual_seed(3)
    v, u = torch.randn(model.d_model, generator=g), torch.randn(model.d_model, generator=g)
    return [SteerSpec.add("resid_post.1", v, scale=3.0),
            SteerSpec.ablate("resid_mid.1", u) | SteerSpec.set("resid_pre.2", v * 2, positions=[3]),
            SteerSpec.add("attn_out.0", v, scale=4.0, positions="prompt")
            | SteerSpec.add("mlp_out.2", u, scale=4.0, positions="generated"),
            SteerSpec.add("resid_pre.0", torch.stack([v, u]) * 3, positions=[1, 4])]


@check("steered greedy tokens and logprobs equal eager and hook vLLM; no recompiles")
def steering(eager, hooks, static) -> str:
    from interp_engine import generate_stream, steer

    tokens = eager.to_tokens(PROMPTS[1])
    before = None
    changed = 0
    plain = [s.token_id for s in generate_stream(eager, tokens, max_tokens=8, temperature=0.0)]
    for i, spec in enumerate(_specs(eager)):
        if i == 1:  # after the first steered run (vLLM compiles sampler helpers on first use)
            before = static.backend.rpc("interp_static_info")[0]["counts"]
        runs = []
        for model in (eager, hooks, static):
            with steer(model, spec):
                runs.append(list(generate_stream(model, tokens, max_tokens=8, temperature=0.0, n_logprobs=3)))
        for other, name in ((runs[1], "hooks"), (runs[2], "static")):
            assert [s.token_id for s in other] == [s.token_id for s in runs[0]], f"spec {i}: {name} tokens"
            for a, b in zip(runs[0], other):
                got = torch.tensor([d["logprob"] for d in b.logprobs])
                want = torch.tensor([d["logprob"] for d in a.logprobs])
                torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5, msg=f"spec {i}: {name} logprobs")
        changed += [s.token_id for s in runs[0]] != plain
    after = static.backend.rpc("interp_static_info")[0]["counts"]
    assert after == before, f"new vectors recompiled: counters {before} -> {after}"
    assert after["dynamo_graph_breaks"] == 0, after
    assert changed >= 2, "the specs do not steer: check is void"
    return f"{changed} of {len(_specs(eager))} specs changed the tokens"


@check("concurrent requests steer differently, each like eager")
def concurrent(eager, static) -> str:
    tokens = eager.to_tokens(PROMPTS[0])
    specs = [None, *_specs(eager)]

    async def texts(model):
        return await asyncio.gather(*[model.generate_text(tokens, max_tokens=8, temperature=0.0, steer=s)
                                      for s in specs])

    got, want = asyncio.run(texts(static)), asyncio.run(texts(eager))
    assert got == want, (got, want)
    assert len(set(got)) > 2, "the specs do not steer: check is void"
    return f"{len(specs)} requests in one batch"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="dry run on CPU (graph_replay expected false)")
    parser.add_argument("--arch", default="qwen3", help="a tiny architecture (3 layers) from interp_engine.testing")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if args.cpu:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    elif not torch.cuda.is_available():
        print("no CUDA device here: run with --cpu for the dry run", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu else "cuda"
    from interp_engine.testing import tiny_model

    kernel_hazard(device)
    eager, hooks, static = load(tiny_model(args.arch), device)
    try:
        static.warmup()
        hooks.warmup()
        graphs(static, hooks, args.cpu)
        points(eager, hooks, static)
        generation(eager, static)
        steering(eager, hooks, static)
        concurrent(eager, static)
    finally:
        static.close()
        hooks.close()
    failed = [name for name, ok, _ in RESULTS if not ok]
    print(f"\n{len(RESULTS) - len(failed)} of {len(RESULTS)} checks passed on {device}"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
