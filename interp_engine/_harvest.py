"""Harvest: activations of a whole prompt set to disk, as a dataset SAELens trains from.

Rows. Every prompt is tokenized as the model's tokenizer does for one text (BOS included where
the tokenizer adds one); the token streams are concatenated in order and cut into windows, as
SAELens's own token datasets are. Each window is one independent forward: one row of
``context_size`` positions. With ``max_tokens=0`` a window is ``context_size`` prompt tokens;
with ``max_tokens=G > 0`` a window is ``context_size - G + 1`` prompt tokens followed by ``G``
greedily generated ones, and the row holds the ``context_size`` positions the model was fed
(the last generated token never is). Tokens after the last full window are left out and
counted in the report and the manifest (``tokens_left_out``). No row is ever padded, so no
padding is ever written.

Engines. eager runs whole batches of windows (``batch_size``) through one forward, or
generates window by window. vLLM runs up to ``max_in_flight`` requests at once, so continuous
batching fills each engine step; the worker runtime writes each request's rows straight into a
file the shard writer maps (``_sunk_rows``), so only a small answer comes back per request.

Memory holds the shard being written at most (``shard_bytes``); the manifest makes an
interrupted run resumable (see ``_harvest_store``).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import math
import mmap
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from ._address import AddressLike, expand_points
from ._capabilities import CapabilityUnsupported
from ._harvest_store import _TMP, Harvested, ManifestMismatch, Store, load
from ._model import Model
from ._plan import capture_plan

__all__ = ["HarvestReport", "ManifestMismatch", "harvest", "read_prompts"]


@dataclass(frozen=True)
class HarvestReport:
    """What one call did: rows and tokens in the dataset, what this call added, the time it took."""

    out: Path
    rows: int
    tokens: int
    rows_this_run: int
    rows_resumed: int
    shards: int
    tokens_left_out: int
    seconds: float
    points: tuple[str, ...] = ()  # the addresses harvested (patterns expanded), one column each

    @property
    def tokens_per_second(self) -> float:
        """Tokens this call harvested per second of its wall time."""
        per_row = self.tokens // self.rows if self.rows else 0
        return self.rows_this_run * per_row / self.seconds if self.seconds else 0.0


# ---- prompts ----------------------------------------------------------------------------

def read_prompts(path: str | os.PathLike) -> Iterator[str]:
    """Prompts from a file: JSONL (one object per line with a ``"text"`` field, or a JSON
    string) when the name ends in ``.jsonl``, otherwise one prompt per non-empty line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompt file {path} does not exist")
    jsonl = path.suffix == ".jsonl"
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line.strip():
                continue
            if not jsonl:
                yield line
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n} is not JSON ({exc.msg}); a .jsonl prompt file holds "
                                 "one JSON object with a \"text\" field per line") from None
            text = item.get("text") if isinstance(item, dict) else item
            if not isinstance(text, str):
                raise ValueError(f"{path}:{n} has no \"text\" string; a .jsonl prompt file holds "
                                 "one JSON object with a \"text\" field per line")
            yield text


class _Prompts:
    """A prompt source that can be read more than once (a list, or a file read again)."""

    def __init__(self, prompts: Sequence[str] | str | os.PathLike) -> None:
        if isinstance(prompts, (str, os.PathLike)):
            self.path: Path | None = Path(prompts)
            if not self.path.is_file():
                raise FileNotFoundError(
                    f"prompts={str(prompts)!r} is not a file; pass a list of strings or the path "
                    "of a text (one prompt per line) or .jsonl file")
            self.items: list[str] | None = None
            self.source = str(self.path.resolve())
        else:
            items = list(prompts)
            if not items or not all(isinstance(p, str) for p in items):
                raise TypeError("prompts must be a non-empty list of strings or a file path")
            self.path, self.items, self.source = None, items, f"list of {len(items)} prompts"

    def __iter__(self) -> Iterator[str]:
        return iter(self.items) if self.items is not None else read_prompts(self.path)

    def digest(self) -> str:
        h = hashlib.sha256()
        for text in self:
            h.update(text.encode("utf-8"))
            h.update(b"\0")
        return h.hexdigest()


class _Windows:
    """Consecutive ``length``-token windows of the concatenated token stream; ``left_out``
    counts the tokens after the last full window once the stream is exhausted."""

    def __init__(self, tokenize: Callable[[list[str]], list[list[int]]], prompts: _Prompts, length: int) -> None:
        self.tokenize, self.prompts, self.length = tokenize, prompts, length
        self.left_out = 0

    def __iter__(self) -> Iterator[list[int]]:
        buffer: list[int] = []
        texts = iter(self.prompts)
        while batch := list(itertools.islice(texts, _TOKENIZE_BATCH)):
            for ids in self.tokenize(batch):
                buffer.extend(ids)
                while len(buffer) >= self.length:
                    yield buffer[:self.length]
                    del buffer[:self.length]
        self.left_out = len(buffer)


_TOKENIZE_BATCH = 64  # prompts tokenized in one call (a call per prompt costs about a quarter more)


def _tokenizer(hf) -> Callable[[list[str]], list[list[int]]]:
    """How harvest tokenizes prompts: each as the model's tokenizer does one text (no padding,
    no truncation), several in one call."""
    return lambda texts: hf(texts, add_special_tokens=True)["input_ids"]


# ---- identity of a run (what a resume must match) ------------------------------------------

def _tokenizer_digest(model: Model) -> str:
    hf = model.tok.hf
    backend = getattr(hf, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else json.dumps(sorted(hf.get_vocab().items()))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _model_digest(model: Model) -> str:
    config = model.config.to_json_string() if hasattr(model.config, "to_json_string") else repr(model.config)
    return hashlib.sha256(config.encode("utf-8")).hexdigest()[:16]


_WRITE_ROWS = 64  # rows handed to the shard writer at once


# ---- engines ------------------------------------------------------------------------------

def _flat(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """``[rows, ctx, ...]`` -> ``[rows, ctx, d_in]`` float32."""
    if isinstance(t, np.ndarray):
        return t.reshape(t.shape[0], t.shape[1], -1).astype(np.float32, copy=False)
    return t.detach().to("cpu", torch.float32).reshape(t.shape[0], t.shape[1], -1).numpy()


def _eager_prompt_rows(model: Model, windows: list[list[int]], reads, batch_size: int):
    from ._api import run_with_cache

    for start in range(0, len(windows), batch_size):
        ids = torch.tensor(windows[start:start + batch_size], dtype=torch.long)
        cache = run_with_cache(model, ids, list(reads))
        yield ids, {a: cache[a] for a in reads}


async def _one_request(model: Model, window: list[int], reads, gen: int, gate: asyncio.Semaphore):
    async with gate:
        completion, values = await model.capture_generation(
            window, list(reads), max_tokens=gen, temperature=0.0, stop_at_eos=False)
    fed = (window + list(completion.token_ids))[: len(window) + gen - 1]
    return torch.tensor([fed], dtype=torch.long), values


def _request_rows(model: Model, windows: list[list[int]], reads, gen: int, in_flight: int):
    """Every window as its own request, ``in_flight`` at once; results in window order."""
    async def run():
        gate = asyncio.Semaphore(in_flight)
        return await asyncio.gather(*(_one_request(model, w, reads, gen, gate) for w in windows))

    for ids, values in asyncio.run(run()):
        yield ids, values


def _sunk_rows(model: Model, plan, windows: list[list[int]], gen: int, in_flight: int, raw: Path,
               columns: dict[str, int], context_size: int):
    """vLLM: the workers write each request's rows straight into ``raw`` (a float32 file laid out
    as each point's ``[windows, context_size, d_in]`` block in turn), so only small answers come
    back per request. Yields the shard's rows in window order, at least ``_WRITE_ROWS`` at a time,
    as soon as every window before them has finished: each point's rows of those windows are one
    run of the file, mapped (``_mapped``) rather than copied, so the shard writer reads the
    workers' pages in place."""
    n = len(windows)
    sizes = {a: context_size * columns[str(a)] for a in plan.reads}  # floats per row
    base, at = {}, 0
    for a in plan.reads:
        base[a], at = at, at + n * sizes[a]
    with open(raw, "wb") as f:
        f.truncate(at * 4)
    offsets = lambda i: {str(a): 4 * (base[a] + i * sizes[a]) for a in plan.reads}  # noqa: E731
    fed: list[list[int] | None] = [None] * n
    ready = given = 0  # windows [0, ready) are finished, [0, given) handed on
    fd = os.open(raw, os.O_RDWR)

    def hand_on(stop: int):
        ids = torch.tensor(fed[given:stop], dtype=torch.long)
        values = {a: _mapped(fd, 4 * (base[a] + given * sizes[a]), (stop - given, context_size, columns[str(a)]))
                  for a in plan.reads}
        return ids, values

    try:
        for i, generated, sent in model.backend.harvest_into(windows, plan, gen, in_flight, str(raw.resolve()),
                                                             offsets, context_size):
            fed[i] = (windows[i] + list(generated))[: len(windows[i]) + gen - 1]
            for a, t in sent.items():  # what the workers could not write whole (tensor-parallel slices)
                if t.numel() != sizes[a]:
                    raise RuntimeError(f"{a}: the workers sent {tuple(t.shape)} for window {i}, not "
                                       f"{context_size} rows of {columns[str(a)]}")
                _file_io(os.pwritev, fd, t.to(torch.float32).contiguous().numpy(), 4 * (base[a] + i * sizes[a]))
            while ready < n and fed[ready] is not None:
                ready += 1
            if ready - given >= _WRITE_ROWS:  # requests finish about in order: rows go on as they come
                yield hand_on(ready)
                given = ready
        if given < n:
            yield hand_on(n)
    finally:
        os.close(fd)


def _mapped(fd: int, at: int, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 array ``shape`` at byte ``at`` of ``fd``, read-only, over a mapping of the
    file rather than a copy. The pages are mapped in one call (``MAP_POPULATE``): they are in the
    page cache already (the workers just wrote them), so no page faults one by one. The mapping
    lives as long as the array (the file may be unlinked before then)."""
    nbytes = 4 * math.prod(shape)
    start = at - at % mmap.ALLOCATIONGRANULARITY
    if os.fstat(fd).st_size < at + nbytes:
        raise OSError(f"the harvest rows file ends before byte {at + nbytes}: the rows the workers wrote are not all there")
    mapping = mmap.mmap(fd, at + nbytes - start, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                        prot=mmap.PROT_READ, offset=start)
    return np.frombuffer(mapping, dtype=np.float32, count=nbytes // 4, offset=at - start).reshape(shape)


def _file_io(call, fd: int, array: np.ndarray, at: int) -> None:
    """All of ``array``'s bytes read from (``os.preadv``) or written to (``os.pwritev``) ``fd``
    at byte ``at``."""
    view = memoryview(array).cast("B")
    while view:
        n = call(fd, [view], at)
        if n <= 0:
            raise OSError(f"the harvest rows file ended at byte {at}: the rows the workers wrote are not all there")
        view, at = view[n:], at + n


def _progress(enabled: bool | None, resumed: int):
    from tqdm.auto import tqdm

    disable = (not sys.stderr.isatty()) if enabled is None else not enabled
    return tqdm(desc="harvest", unit=" rows", initial=resumed, disable=disable, dynamic_ncols=True)


# ---- the public function ------------------------------------------------------------------

def harvest(model: Model, prompts: Sequence[str] | str | os.PathLike,
            points: Sequence[AddressLike] | AddressLike, out: str | os.PathLike, *,
            context_size: int = 128, max_tokens: int = 0, batch_size: int = 8,
            max_in_flight: int = 64, shard_bytes: int = 256 * 2**20,
            progress: bool | None = None, window_range: tuple[int, int] | None = None) -> HarvestReport:
    """Capture ``points`` over every window of ``prompts`` and write them to ``out`` as a
    dataset SAELens reads as cached activations; returns a HarvestReport.

    ``points``: addresses, or patterns as ``run_with_cache`` takes them (``"resid_post.*"``,
    ``"*.3"``), expanded against the model; the manifest records the expanded addresses, so a
    resume with the pattern or with the addresses it names is the same run.
    ``prompts``: a list of strings, or a text file (one prompt per line) or ``.jsonl`` file
    (a ``"text"`` field per line). Rows are ``context_size``-token windows of the concatenated
    token stream (see the module doc); ``max_tokens > 0`` also captures generated positions
    (greedy). ``batch_size``: windows per eager forward; ``max_in_flight``: concurrent vLLM
    requests; ``shard_bytes``: the most one shard holds in memory and on disk. Calling again
    with the same arguments resumes an interrupted run (or returns at once when it finished);
    other arguments are refused. ``progress``: a progress bar (default: when stderr is a TTY).
    ``window_range=(start, stop)`` harvests only those windows of the stream (what one replica
    of ``harvest_ray`` takes).
    """
    started = time.perf_counter()
    if not isinstance(model, Model):
        raise TypeError(f"harvest takes a Model from load_model, got {type(model).__name__}")
    for name, value, low in (("context_size", context_size, 1), ("max_tokens", max_tokens, 0),
                             ("batch_size", batch_size, 1), ("max_in_flight", max_in_flight, 1),
                             ("shard_bytes", shard_bytes, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if max_tokens > context_size:
        raise ValueError(f"max_tokens={max_tokens} is more than context_size={context_size}: a row "
                         "holds the prompt window and the generated tokens, so use max_tokens <= context_size")
    if window_range is not None:
        start, stop = window_range
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop):
            raise ValueError(f"window_range must be (start, stop) with 0 <= start <= stop, got {window_range!r}")
    gen = max(max_tokens, 1)
    window_len = context_size - gen + 1
    room = model.max_model_len
    if window_len + gen > room:
        raise ValueError(f"a window of {window_len} prompt tokens plus {gen} generated needs "
                         f"{window_len + gen} positions, this model's context holds {room} "
                         f"(max_model_len): use context_size <= {room - 1}")
    plan = capture_plan(model.graph, expand_points(model.graph, points))
    reads = plan.reads  # patterns expanded: the manifest and the columns name every address
    for address in reads:
        dims = model.graph.point(address.name).dims
        if dims[:2] != ("batch", "pos"):
            raise CapabilityUnsupported(
                "harvest_point", model.backend_name, why="harvest writes one row per token",
                instead="harvest per-token points (resid_*, attn_out, mlp_out, z, ...)",
                detail=f"{address} is shaped [{', '.join(dims)}]")
    from ._api import _refuse

    _refuse(model, plan)
    prompt_source = _Prompts(prompts)
    shapes = {str(a): list(model.graph.shape_of(a, 1, 1)[2:]) for a in reads}
    columns = {name: math.prod(shape) for name, shape in shapes.items()}
    row_bytes = context_size * 4 * (sum(columns.values()) + 1)
    shard_rows = max(1, shard_bytes // row_bytes)
    args = {
        "model": model.name, "model_config": _model_digest(model), "backend": model.backend_name,
        "dtype": str(model.dtype).removeprefix("torch."), "stored_dtype": "float32",
        "tokenizer": _tokenizer_digest(model), "points": [str(a) for a in reads],
        "context_size": context_size, "max_tokens": max_tokens, "generation": "greedy",
        "prompt_source": prompt_source.source, "prompt_sha256": prompt_source.digest(),
        "shard_rows": shard_rows, "window_range": list(window_range) if window_range else None,
    }
    store = Store(out, args, columns, shapes)
    done = store.open()
    if store.complete:
        return _report(store, started, done, 0)
    stream = _Windows(_tokenizer(model.tok.hf), prompt_source, window_len)
    windows = iter(stream)
    first, last = window_range or (0, None)
    if last is not None:
        windows = itertools.islice(windows, last)
    for _ in range(first + done):  # windows before the range, and those of finished shards
        next(windows, None)
    bar = _progress(progress, done)
    written = 0
    try:
        while True:
            chunk = [w for _, w in zip(range(shard_rows), windows)]
            if not chunk:
                break
            writer = store.shard()
            raw = writer.path.with_name(writer.path.name + ".rows" + _TMP)  # the workers' rows (vLLM)
            rows = None
            try:
                if model.backend_name == "eager" and max_tokens == 0:
                    rows = _eager_prompt_rows(model, chunk, reads, batch_size)
                    group = 1  # each item is a batch already
                elif model.backend.sinks(plan):
                    rows = _sunk_rows(model, plan, chunk, gen, max_in_flight, raw, columns, context_size)
                    group = 1  # each item is _WRITE_ROWS rows already
                else:
                    rows = _request_rows(model, chunk, reads, gen, max_in_flight)
                    group = _WRITE_ROWS  # one row per request: Arrow's cost is per write, so gather them
                pending: list = []

                def flush() -> None:
                    nonlocal written
                    if not pending:
                        return
                    if len(pending) == 1:  # (a vLLM sink's rows come as one piece already: no copy)
                        ids, values = pending[0]
                        batch = {str(a): _flat(values[a]) for a in reads}
                        batch["token_ids"] = ids.to(torch.int32).numpy()
                    else:
                        batch = {str(a): np.concatenate([_flat(v[a]) for _, v in pending]) for a in reads}
                        batch["token_ids"] = np.concatenate([i.to(torch.int32).numpy() for i, _ in pending])
                    pending.clear()
                    writer.write(batch)
                    n = len(batch["token_ids"])
                    written += n
                    bar.update(n)
                    bar.set_postfix(tok_s=f"{written * context_size / (time.perf_counter() - started):.0f}")

                for ids, values in rows:
                    pending.append((ids, values))
                    if len(pending) >= group:
                        flush()
                flush()
            except BaseException:
                if rows is not None:
                    rows.close()  # its requests leave the engine now, not when it is collected
                writer.discard()
                raise
            finally:
                raw.unlink(missing_ok=True)
            store.finish_shard(writer, writer.rows * context_size)
    finally:
        bar.close()
    store.finish({"tokens_left_out": stream.left_out})
    return _report(store, started, done, written)


def _report(store: Store, started: float, resumed: int, written: int) -> HarvestReport:
    manifest = json.loads((store.dir / "manifest.json").read_text())
    ctx = int(manifest["args"]["context_size"])
    return HarvestReport(store.dir, manifest["rows"], manifest["rows"] * ctx, written, resumed,
                         len(manifest["shards"]), int(manifest.get("tokens_left_out", 0)),
                         time.perf_counter() - started, tuple(manifest["args"]["points"]))


harvest.load = load  # type: ignore[attr-defined]
