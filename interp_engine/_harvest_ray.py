"""Harvest across replicas with Ray Data: one engine actor per replica, one shard set each,
one manifest over all of them.

The driver tokenizes the prompt set once to count its windows and splits them into as many
contiguous ranges as there are replicas. Ray Data's ``map_batches`` runs an actor pool of
that size; each actor loads the model once (in its own process, on whatever backend was
asked) and runs an ordinary, resumable ``harvest`` of its range into ``out/replica-K``. The
driver then writes the dataset files and a manifest that list every replica's shards in
window order, so ``datasets.load_from_disk(out)`` and ``harvest.load(out)`` see one dataset
whose rows are exactly those of a single-engine harvest.

Why not ``ray.data.llm``: its vLLM stage owns the engine and returns what vLLM generates per
row; the captures of this library come back from the engine's workers through
``collective_rpc`` on the engine the caller holds, which that stage does not expose. The actor
pool is the pattern ``ray.data.llm`` is built on, with the engine in our hands.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from ._address import AddressLike
from ._harvest import HarvestReport, _Prompts, _tokenizer, _Windows, harvest
from ._harvest_store import MANIFEST, Store

__all__ = ["harvest_ray"]


class _Replica:
    """A Ray Data actor: one model, loaded once, harvesting the ranges it is handed."""

    def __init__(self, path: str, backend: str, load_kwargs: Mapping[str, Any], prompts: Any,
                 points: list[str], out: str, harvest_kwargs: Mapping[str, Any]) -> None:
        from ._model import load_model

        self.model = load_model(path, backend=backend, **dict(load_kwargs))
        self.prompts, self.points, self.out = prompts, points, out
        self.kwargs = dict(harvest_kwargs)

    def __call__(self, batch: dict) -> dict:
        reports = []
        for replica, start, stop in zip(batch["replica"], batch["start"], batch["stop"]):
            report = harvest(self.model, self.prompts, self.points, Path(self.out) / f"replica-{int(replica)}",
                             window_range=(int(start), int(stop)), progress=False, **self.kwargs)
            reports.append(json.dumps({"replica": int(replica), "rows": report.rows,
                                       "rows_this_run": report.rows_this_run, "seconds": report.seconds}))
        return {"report": reports}


def harvest_ray(model: str | os.PathLike, prompts: Sequence[str] | str | os.PathLike,
                points: Sequence[AddressLike] | AddressLike, out: str | os.PathLike, *,
                replicas: int = 2, backend: str = "eager", load_kwargs: Mapping[str, Any] | None = None,
                num_cpus_per_replica: float = 1, context_size: int = 128, max_tokens: int = 0,
                **harvest_kwargs) -> HarvestReport:
    """``harvest`` of ``model`` (a path or hub name: each replica loads it) over ``replicas``
    Ray actors, into one dataset at ``out``. Uses the running Ray instance, or starts a local
    one. Resumable as ``harvest`` is: each replica resumes its own range."""
    import ray

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be an int >= 1, got {replicas!r}")
    source = _Prompts(prompts)
    from transformers import AutoTokenizer

    from ._model import resolve_model_path

    path = str(resolve_model_path(model))
    gen = max(max_tokens, 1)
    stream = _Windows(_tokenizer(AutoTokenizer.from_pretrained(path)), source, context_size - gen + 1)
    total = sum(1 for _ in stream)
    if total == 0:
        raise ValueError(f"the prompts make no full window of {context_size - gen + 1} tokens: "
                         "pass more text or a smaller context_size")
    bounds = [total * k // replicas for k in range(replicas + 1)]
    ranges = [{"replica": k, "start": bounds[k], "stop": bounds[k + 1]} for k in range(replicas)]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    prompt_arg = source.items if source.items is not None else str(source.path)
    kwargs = dict(harvest_kwargs, context_size=context_size, max_tokens=max_tokens)
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, int(replicas * num_cpus_per_replica)), include_dashboard=False,
                 log_to_driver=False)
    dataset = ray.data.from_items(ranges).map_batches(
        _Replica, batch_size=1, concurrency=replicas, num_cpus=num_cpus_per_replica,
        fn_constructor_kwargs=dict(path=path, backend=backend, load_kwargs=dict(load_kwargs or {}),
                                   prompts=prompt_arg, points=[str(p) for p in _as_list(points)],
                                   out=str(out), harvest_kwargs=kwargs))
    reports = sorted((json.loads(r["report"]) for r in dataset.take_all()), key=lambda r: r["replica"])
    return _merge(out, replicas, stream.left_out, reports)


def _as_list(points) -> list:
    return list(points) if isinstance(points, (list, tuple)) else [points]


def _merge(out: Path, replicas: int, left_out: int, reports: list[dict]) -> HarvestReport:
    """One manifest and one dataset over the replicas' shards, in window order."""
    manifests = [json.loads((out / f"replica-{k}" / MANIFEST).read_text()) for k in range(replicas)]
    if not all(m["complete"] for m in manifests):
        raise RuntimeError(f"a replica of the harvest in {out} did not finish: rerun to resume it")
    first = manifests[0]
    args = {k: v for k, v in first["args"].items() if k != "window_range"}
    args["replicas"] = [m["args"]["window_range"] for m in manifests]
    store = Store(out, args, first["columns"], first["shapes"])
    store.shards = [dict(s, file=f"replica-{k}/{s['file']}") for k, m in enumerate(manifests) for s in m["shards"]]
    store.finish({"tokens_left_out": left_out, "route": "ray.data map_batches, one engine actor per replica"})
    rows = sum(m["rows"] for m in manifests)
    return HarvestReport(out, rows, rows * int(args["context_size"]), sum(r["rows_this_run"] for r in reports),
                         rows - sum(r["rows_this_run"] for r in reports), len(store.shards), left_out,
                         max(r["seconds"] for r in reports), tuple(args["points"]))
