"""A harvest on disk: a manifest, shards written one at a time, and the dataset they form.

The directory is a Hugging Face ``datasets`` dataset in ``save_to_disk`` layout (what SAELens
opens with ``datasets.load_from_disk`` as cached activations): ``state.json`` and
``dataset_info.json`` next to one Arrow file per shard, one column per point named by its
address (``Array2D((context_size, d_in), "float32")``) and ``token_ids``
(``Sequence(Value("int32"), length=context_size)``).

``manifest.json`` records the arguments of the run and the finished shards. A shard is written
under a temporary name and renamed when complete, then the manifest is rewritten (also by
rename), so a run killed at any moment leaves finished shards, maybe one temporary file, and a
manifest that names exactly the finished ones. ``state.json`` appears only when every shard is
there: a partial harvest is never mistaken for a dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
import torch

__all__ = ["FORMAT", "Harvested", "ManifestMismatch", "ShardWriter", "Store", "load"]

FORMAT = "interp_engine.harvest/1"
MANIFEST = "manifest.json"
_TMP = ".partial"


class ManifestMismatch(ValueError):
    """A resumed harvest whose arguments differ from the run that started the directory."""


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_name(path.name + _TMP)
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def features(columns: Mapping[str, int], context_size: int):
    """The dataset's features: ``columns`` maps a point's column name to its width ``d_in``."""
    from datasets import Array2D, Features, Sequence, Value

    table = {name: Array2D(shape=(context_size, width), dtype="float32") for name, width in columns.items()}
    table["token_ids"] = Sequence(Value("int32"), length=context_size)
    return Features(table)


def _arrow(values: np.ndarray, feature):
    """``values`` (``[rows, ctx, d_in]`` for an Array2D column, ``[rows, ctx]`` for token_ids)
    as an Arrow array of ``feature``'s type: the layout ``datasets`` itself writes."""
    import pyarrow as pa

    rows, ctx = values.shape[0], values.shape[1]
    if values.ndim == 2:  # token_ids: Sequence(Value("int32"), length=ctx)
        flat = pa.array(np.ascontiguousarray(values, dtype=np.int32).reshape(-1))
        return pa.FixedSizeListArray.from_arrays(flat, ctx)
    width = values.shape[2]
    flat = pa.array(np.ascontiguousarray(values, dtype=np.float32).reshape(-1))
    inner = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * ctx * width + 1, width, dtype=np.int32)), flat)
    outer = pa.ListArray.from_arrays(pa.array(np.arange(0, rows * ctx + 1, ctx, dtype=np.int32)), inner)
    return pa.ExtensionArray.from_storage(feature(), outer)


class ShardWriter:
    """One shard being written: rows go straight to an Arrow file under a temporary name;
    ``close`` renames it into place. Holds no rows itself."""

    def __init__(self, path: Path, feats) -> None:
        from datasets.arrow_writer import ArrowWriter

        self.path = path
        self.features = feats
        self.tmp = path.with_name(path.name + _TMP)
        self.rows = 0
        self._writer = ArrowWriter(features=feats, path=str(self.tmp))

    def write(self, columns: Mapping[str, np.ndarray]) -> None:
        """``columns``: name -> ``[rows, context_size, d_in]`` float32 (``token_ids`` int32)."""
        n = len(columns["token_ids"])
        # Arrow arrays of the features' own types, built over the numbers in one piece: handing
        # the writer a list of per-row arrays makes it convert row by row (most of a vLLM
        # harvest's client time, measured)
        self._writer.write_batch({name: _arrow(values, self.features[name]) for name, values in columns.items()})
        self.rows += n

    def close(self) -> None:
        self._writer.finalize()
        self._writer.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        try:
            self._writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)


class Store:
    """The directory of one harvest: its manifest, its shards, its finished dataset."""

    def __init__(self, out: str | os.PathLike, args: Mapping[str, Any], columns: Mapping[str, int],
                 shapes: Mapping[str, list[int]]) -> None:
        self.dir = Path(out)
        self.args = dict(args)
        self.columns = dict(columns)
        self.shapes = dict(shapes)
        self.features = features(self.columns, int(self.args["context_size"]))
        self.shards: list[dict] = []

    # ---- starting or resuming ----------------------------------------------------------
    def open(self) -> int:
        """Create the directory, or resume it: returns the number of finished rows. Arguments
        that differ from the manifest's are refused, naming each difference."""
        path = self.dir / MANIFEST
        if path.exists():
            manifest = json.loads(path.read_text())
            if manifest.get("format") != FORMAT:
                raise ManifestMismatch(f"{path} was written by another tool or version "
                                       f"({manifest.get('format')!r}); harvest into a new directory")
            old = manifest.get("args", {})
            diffs = [f"{k}: {old.get(k)!r} there, {self.args.get(k)!r} now"
                     for k in sorted(set(old) | set(self.args)) if old.get(k) != self.args.get(k)]
            if diffs:
                raise ManifestMismatch(
                    f"{self.dir} holds a harvest made with other arguments ({'; '.join(diffs)}); "
                    "resume with the same arguments, or harvest into a new directory")
            self.shards = [s for s in manifest.get("shards", []) if (self.dir / s["file"]).exists()]
            for stray in self.dir.glob(f"*{_TMP}"):  # a shard or manifest cut off mid-write
                stray.unlink()
        else:
            if self.dir.exists() and any(self.dir.iterdir()):
                raise FileExistsError(f"{self.dir} exists and is not a harvest (no {MANIFEST}): "
                                      "pass an empty or new directory as out")
            self.dir.mkdir(parents=True, exist_ok=True)
        self._save(complete=False)
        return sum(s["rows"] for s in self.shards)

    @property
    def complete(self) -> bool:
        path = self.dir / MANIFEST
        return path.exists() and bool(json.loads(path.read_text()).get("complete"))

    # ---- writing -------------------------------------------------------------------------
    def shard(self) -> ShardWriter:
        return ShardWriter(self.dir / f"shard-{len(self.shards):05d}.arrow", self.features)

    def finish_shard(self, writer: ShardWriter, tokens: int) -> None:
        writer.close()
        self.shards.append({"file": writer.path.name, "rows": writer.rows, "tokens": tokens})
        self._save(complete=False)

    def finish(self, extra: Mapping[str, Any]) -> None:
        """Every shard is written: make the directory a dataset ``load_from_disk`` opens."""
        from datasets import DatasetInfo

        info = DatasetInfo(features=self.features,
                           description=f"activations harvested by interp_engine ({FORMAT})")
        info.write_to_directory(str(self.dir))
        digest = hashlib.sha256(json.dumps(self.shards, sort_keys=True).encode()).hexdigest()[:16]
        _write_json(self.dir / "state.json", {
            "_data_files": [{"filename": s["file"]} for s in self.shards],
            "_fingerprint": digest, "_format_columns": None, "_format_kwargs": {},
            "_format_type": None, "_output_all_columns": False, "_split": None,
        })
        self._save(complete=True, extra=extra)

    def _save(self, complete: bool, extra: Mapping[str, Any] | None = None) -> None:
        data = {"format": FORMAT, "args": self.args, "columns": self.columns, "shapes": self.shapes,
                "shards": self.shards, "rows": sum(s["rows"] for s in self.shards),
                "complete": complete}
        data.update(extra or {})
        _write_json(self.dir / MANIFEST, data)


@dataclass(frozen=True)
class Harvested:
    """A harvest read back as plain tensors: ``values[address]`` is ``[rows, context_size, ...]``
    in its point's own shape, ``token_ids`` is ``[rows, context_size]``; ``manifest`` is the JSON."""

    values: Mapping[str, torch.Tensor]
    token_ids: torch.Tensor
    manifest: Mapping[str, Any]

    def __getitem__(self, address: str) -> torch.Tensor:
        return self.values[str(address)]


def _read_shards(directory: Path, manifest: Mapping[str, Any]) -> Iterable[Any]:
    import pyarrow as pa

    for shard in manifest["shards"]:
        with pa.memory_map(str(directory / shard["file"])) as source:
            yield pa.ipc.open_stream(source).read_all()


def _values(column) -> np.ndarray:
    """The numbers of a nested (or Array2D extension) Arrow column, flat."""
    import pyarrow as pa

    if isinstance(column, pa.ExtensionArray):
        column = column.storage
    while pa.types.is_list(column.type) or pa.types.is_fixed_size_list(column.type) \
            or pa.types.is_large_list(column.type):
        column = column.flatten()
    return np.asarray(column.to_numpy(zero_copy_only=False))


def load(directory: str | os.PathLike, points: Iterable[str] | None = None) -> Harvested:
    """A finished harvest as tensors, without SAELens or ``datasets`` (only pyarrow)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.exists():
        raise FileNotFoundError(f"{directory} holds no harvest ({MANIFEST} is missing)")
    manifest = json.loads(path.read_text())
    if not manifest.get("complete"):
        raise ValueError(f"the harvest in {directory} is unfinished ({manifest['rows']} rows so far): "
                         "rerun harvest with the same arguments to complete it")
    names = list(manifest["columns"]) if points is None else [str(p) for p in points]
    unknown = [n for n in names if n not in manifest["columns"]]
    if unknown:
        raise KeyError(f"{unknown} were not harvested; this harvest holds {list(manifest['columns'])}")
    ctx = int(manifest["args"]["context_size"])
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in names + ["token_ids"]}
    for table in _read_shards(directory, manifest):
        for name in names + ["token_ids"]:
            array = _values(table.column(name).combine_chunks())
            width = 1 if name == "token_ids" else int(manifest["columns"][name])
            parts[name].append(torch.from_numpy(array.copy()).reshape(table.num_rows, ctx, width))
    token_ids = torch.cat(parts.pop("token_ids")).reshape(-1, ctx).long()
    values = {n: torch.cat(parts[n]).reshape(-1, ctx, *manifest["shapes"][n]) for n in names}
    return Harvested(values, token_ids, manifest)
