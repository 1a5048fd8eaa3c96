"""``interp-engine serve``: vLLM's OpenAI-compatible server with the runtime in its workers,
driven with the ``openai`` client package against a server this module starts on 127.0.0.1.

Numbers are compared with the eager backend on the same weights (greedy tokens and logprobs,
captured rows), not with the code under test."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import time

import pytest
import torch

pytestmark = pytest.mark.vllm

openai = pytest.importorskip("openai")
pytest.importorskip("vllm")

from interp_engine import SteerSpec, capture_generation, generate_stream, steer  # noqa: E402
from interp_engine.testing import tiny_model  # noqa: E402

ARCH = "qwen3"
POINT = "resid_post.1"
SCALE = 3.0
MAX_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vector() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    v = torch.randn(128, generator=g)
    return v / v.norm()


@pytest.fixture(scope="module")
def server(tmp_path_factory, vector):
    from bridge.vllm.server import serve_command
    from bridge.vllm.wire import VectorRegistry

    root = tmp_path_factory.mktemp("serve")
    vectors = root / "vectors.safetensors"
    VectorRegistry.save(vectors, {"probe": vector}, {"probe": POINT})
    port = _free_port()
    command, env = serve_command(str(tiny_model(ARCH)), str(vectors), str(root / "captures"),
                                 port=port, extra=["--dtype", "float32", "--max-model-len", "256"])
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited ({proc.returncode}):\n{(root / 'server.log').read_text()[-4000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not come up in 300 s:\n" + (root / "server.log").read_text()[-4000:])
            time.sleep(1)
        yield base
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        log.close()


@pytest.fixture(scope="module")
def eager(model_pool):
    return model_pool.get(ARCH)


def _prompt(eager) -> list[int]:
    return eager.to_tokens("The capital of France is")[0].tolist()


def _served_ids_logprobs(choice) -> tuple[list[int], list[float]]:
    tokens = choice.logprobs.tokens  # "token_id:123" with return_tokens_as_token_ids
    return [int(t.split(":", 1)[1]) for t in tokens], list(choice.logprobs.token_logprobs)


def _eager_ids_logprobs(model, prompt, spec=None) -> tuple[list[int], list[float]]:
    tokens = torch.tensor([prompt])
    if spec is None:
        steps = list(generate_stream(model, tokens, max_tokens=MAX_TOKENS, temperature=0.0,
                                     stop_at_eos=False, n_logprobs=1))
    else:
        with steer(model, spec):
            steps = list(generate_stream(model, tokens, max_tokens=MAX_TOKENS, temperature=0.0,
                                         stop_at_eos=False, n_logprobs=1))
    return [s.token_id for s in steps], [s.logprob for s in steps]


def _complete(client, prompt, xargs=None):
    body = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    if xargs:
        body["vllm_xargs"] = xargs
    return client.completions.create(model=str(tiny_model(ARCH)), prompt=prompt, max_tokens=MAX_TOKENS,
                                     temperature=0.0, logprobs=1, extra_body=body)


def test_steered_and_plain_requests_sent_together_each_equal_eager(server, eager, vector):
    prompt = _prompt(eager)

    async def both():
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none")
        try:
            return await asyncio.gather(
                _complete(client, prompt, {"interp_steer": "probe", "interp_scale": SCALE}),
                _complete(client, prompt))
        finally:
            await client.close()

    steered, plain = asyncio.run(both())
    want_plain = _eager_ids_logprobs(eager, prompt)
    want_steered = _eager_ids_logprobs(eager, prompt, SteerSpec.add(POINT, vector, scale=SCALE))
    assert want_steered[0] != want_plain[0], "the probe vector must change greedy tokens for this test to mean anything"
    for got, want in ((_served_ids_logprobs(plain.choices[0]), want_plain),
                      (_served_ids_logprobs(steered.choices[0]), want_steered)):
        assert got[0] == want[0]
        torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), rtol=1e-5, atol=1e-5)


def test_capture_is_written_to_the_file_the_response_names(server, eager):
    import httpx
    from safetensors.torch import load_file

    prompt = _prompt(eager)
    body = {"model": str(tiny_model(ARCH)), "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "vllm_xargs": {"interp_capture": ["resid_post.1", "mlp_out.2"]}}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    path = response.json()["interp_engine"]["capture_path"]
    assert response.headers["x-interp-engine-capture"] == path
    got = load_file(path)
    _, cache = capture_generation(eager, torch.tensor([prompt]), ["resid_post.1", "mlp_out.2"],
                                  max_tokens=MAX_TOKENS, temperature=0.0, stop_at_eos=False)
    for name in ("resid_post.1", "mlp_out.2"):
        want = cache[name][0]
        assert got[name].shape == want.shape == (len(prompt) + MAX_TOKENS - 1, 128)
        torch.testing.assert_close(got[name], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("xargs, says", [
    ({"interp_capture": ["resid_post.99"]}, "resid_post.99"),
    ({"interp_steer": "nope"}, "nope"),
    ({"interp_capture": ["resid_post.1"], "interp_capture_path": "/tmp/x"}, "interp_capture_path"),
    ({"interp_scale": 2.0}, "interp_steer"),
])
def test_bad_plans_are_refused_with_400_and_the_server_keeps_serving(server, eager, xargs, says):
    import httpx

    prompt = _prompt(eager)
    body = {"model": str(tiny_model(ARCH)), "prompt": prompt, "max_tokens": 2, "vllm_xargs": xargs}
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert says in response.text
    ok = httpx.post(f"{server}/v1/completions", json={**body, "vllm_xargs": {}}, timeout=120)
    assert ok.status_code == 200, ok.text
