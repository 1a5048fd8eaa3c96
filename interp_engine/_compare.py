"""Run one user pipeline on several engines holding the same weights and report where they part.

``compare(fn, models)`` calls ``fn(model)`` on each model (the first is the reference) and
compares what comes back, output by output: captured points (a Cache), tensors, numbers,
generated tokens (GenSteps, a Completion, a list of ids) — in dicts, lists and tuples of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from ._address import Address, format_address
from ._api import Completion, GenStep
from ._cache import Cache
from ._model import Model

__all__ = ["CompareReport", "OutputDiff", "assert_backends_agree", "compare", "default_tolerance"]


def default_tolerance(dtype: torch.dtype, n_layers: int, width: int) -> float:
    """The largest scale-relative difference (``max |a - b| / max |reference|``) two correct
    engines may show on a model of ``n_layers`` layers whose widest reduction is ``width``.

    Reasoning, not tuning: each stored intermediate is rounded to ``dtype`` (unit roundoff
    ``u = eps / 2``), and the engines round at different places (vLLM fuses the residual add
    into the RMSNorm in float32; transformers adds in ``dtype``); each matmul or reduction of
    length ``width`` is accumulated in float32 in a different order (``sqrt(width) * u32``
    for a random walk of roundings). The residual stream meets such a rounding site at the
    embedding and twice per layer (after attention and after the MLP): ``2 * n_layers + 1``
    sites, whose errors add at worst linearly. The factor 8 covers the maximum over many
    elements (about 4 standard deviations) times a gain of 2 from later layers amplifying an
    earlier difference.
    """
    u = torch.finfo(dtype).eps / 2
    u32 = torch.finfo(torch.float32).eps / 2
    return 8 * (u + math.sqrt(width) * u32) * (2 * n_layers + 1)


@dataclass(frozen=True)
class OutputDiff:
    """One output of the pipeline on one engine against the reference engine.

    Numbers: ``max_abs`` and ``rel`` (``max_abs / max |reference|``) with the index of the
    largest difference (``where``; ``position`` is its sequence position for ``[batch, pos,
    ...]`` outputs) and quantiles of the element-wise relative difference. Tokens:
    ``first_divergence`` (step index, or None if equal), the two tokens there, and
    ``near_tie`` (True when the reference's logprobs of the two tokens are within the
    tolerance: either draw is correct; None when no logprobs were asked)."""

    output: str
    engine: str
    kind: str  # "tensor" or "tokens"
    passed: bool
    tolerance: float
    max_abs: float = 0.0
    rel: float = 0.0
    p50: float = 0.0
    p99: float = 0.0
    where: tuple[int, ...] | None = None
    position: int | None = None
    layer: int | None = None
    point: str | None = None
    first_divergence: int | None = None
    tokens: tuple[int, int] | None = None
    near_tie: bool | None = None
    detail: str = ""  # why it failed without numbers (shapes, NaN, lengths)
    note: str = ""  # what was compared, when not everything was

    def describe(self) -> str:
        if self.detail:
            return self.detail
        if self.kind == "tokens":
            if self.first_divergence is None:
                return "tokens equal"
            tie = {True: "near-tie", False: "not a near-tie", None: "near-tie unknown (no logprobs)"}[self.near_tie]
            return (f"first diverging token at step {self.first_divergence}: "
                    f"{self.tokens[0]} vs {self.tokens[1]} ({tie})")
        at = "" if self.where is None else f" at {list(self.where)}"
        note = f"; {self.note}" if self.note else ""
        return f"max |diff| {self.max_abs:.3g}{at}, rel {self.rel:.3g} (tol {self.tolerance:.3g}){note}"


@dataclass(frozen=True)
class CompareReport:
    """What ``compare`` found: one OutputDiff per (output, engine other than the reference)."""

    reference: str
    engines: tuple[str, ...]
    dtype: torch.dtype
    tolerance: float
    diffs: tuple[OutputDiff, ...]

    @property
    def passed(self) -> bool:
        return all(d.passed for d in self.diffs)

    def failures(self) -> tuple[OutputDiff, ...]:
        return tuple(d for d in self.diffs if not d.passed)

    def __getitem__(self, output: str) -> OutputDiff:
        """The (first) diff of ``output``, e.g. ``report["resid_post.1"]``."""
        for d in self.diffs:
            if d.output == output:
                return d
        raise KeyError(f"no output {output!r}; outputs: {sorted({d.output for d in self.diffs})}")

    def table(self, only_failures: bool = False) -> str:
        rows = self.failures() if only_failures else self.diffs
        head = ("output", "engine", "max |diff|", "rel", "p99 rel", "worst at", "pos", "result")
        body = []
        for d in rows:
            if d.kind == "tokens":
                cells = (d.output, d.engine, "", "", "", "", "" if d.first_divergence is None
                         else str(d.first_divergence), d.describe())
            else:
                cells = (d.output, d.engine, f"{d.max_abs:.3g}", f"{d.rel:.3g}", f"{d.p99:.3g}",
                         "" if d.where is None else str(list(d.where)),
                         "" if d.position is None else str(d.position), d.detail or d.note)
            verdict = "ok" if d.passed else "FAIL"
            body.append(cells[:-1] + ((verdict + ("  " + cells[-1] if cells[-1] else "")),))
        widths = [max(len(r[i]) for r in (head, *body)) for i in range(len(head))]
        line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
        verdict = "PASS" if self.passed else f"FAIL ({len(self.failures())} of {len(self.diffs)})"
        dtype = str(self.dtype).removeprefix("torch.")
        title = (f"compare: reference {self.reference} vs {', '.join(self.engines[1:])}; dtype {dtype}, "
                 f"tolerance {self.tolerance:.3g} (scale-relative): {verdict}")
        return "\n".join([title, line(head), *(line(r) for r in body)])

    def __str__(self) -> str:
        return self.table()

    def plot(self, path: str | Path) -> Path:
        """Per layer, each point's relative difference from the reference (log scale), one
        line per (point, engine), the tolerance dashed: a PNG at ``path``."""
        try:
            import matplotlib
        except ImportError as exc:
            raise ImportError("CompareReport.plot needs matplotlib: pip install matplotlib") from exc
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        import matplotlib.ticker

        series: dict[tuple[str, str], dict[int, float]] = {}
        for d in self.diffs:  # the worst over every output of a (point, engine, layer)
            if d.layer is not None and d.kind == "tensor":
                by_layer = series.setdefault((d.point, d.engine), {})
                by_layer[d.layer] = max(by_layer.get(d.layer, 0.0), d.rel)
        if not series:
            raise ValueError("nothing to plot: the pipeline returned no per-layer captures (a Cache)")
        fig, ax = plt.subplots(figsize=(7, 4))
        floor = self.tolerance * 1e-4  # equal tensors (rel 0) drawn at the bottom of the log scale
        for (point, engine), by_layer in sorted(series.items()):
            points = sorted(by_layer.items())
            ax.plot([p[0] for p in points], [max(p[1], floor) for p in points], marker="o",
                    label=f"{point} ({engine})")
        ax.axhline(self.tolerance, linestyle="--", color="grey", label="tolerance")
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("layer")
        ax.set_ylabel(f"max |diff| / max |{self.reference}|")
        ax.set_title(f"{self.reference} vs {', '.join(self.engines[1:])} ({str(self.dtype).removeprefix('torch.')})")
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = Path(path)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path


# ---- flattening what a pipeline returns ---------------------------------------------------

def _flatten(value: Any, name: str, out: dict, layers: dict) -> None:
    if isinstance(value, Cache):
        for address, t in value.items():
            key = _join(name, format_address(address))
            out[key] = t
            layers[key] = address
    elif isinstance(value, torch.Tensor):
        out[name or "output"] = value
    elif isinstance(value, Completion):
        out[_join(name, "tokens")] = _Tokens(list(value.token_ids), None)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, GenStep) for v in value):
        out[_join(name, "tokens")] = _Tokens([s.token_id for s in value], [s.logprobs for s in value])
        if all(s.logprob is not None for s in value):
            out[_join(name, "logprob")] = torch.tensor([s.logprob for s in value], dtype=torch.float64)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                              for v in value):
        out[_join(name, "tokens")] = _Tokens(list(value), None)
    elif isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(v, _join(name, str(k)), out, layers)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _flatten(v, _join(name, str(i)), out, layers)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        out[name or "output"] = torch.tensor(float(value), dtype=torch.float64)
    else:
        raise TypeError(f"compare cannot compare {type(value).__name__} (at {name or 'the output'}): return "
                        "Caches, tensors, numbers, GenSteps, Completions or token ids, in dicts/lists/tuples")


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


@dataclass(frozen=True)
class _Tokens:
    ids: list[int]
    logprobs: list | None  # per step: the reference's top-logprob dicts, or None


# ---- comparing ----------------------------------------------------------------------------

def _tensor_diff(name: str, engine: str, ref: torch.Tensor, other: torch.Tensor, tol: float,
                 address: Address | None) -> OutputDiff:
    layer = address.layer if address is not None else None
    point = address.name if address is not None else None
    if ref.shape != other.shape:
        return OutputDiff(name, engine, "tensor", False, tol, layer=layer, point=point,
                          detail=f"shapes differ: {tuple(ref.shape)} vs {tuple(other.shape)}")
    a = ref.detach().to("cpu", torch.float64)
    b = other.detach().to("cpu", torch.float64)
    diff = (a - b).abs()
    if diff.numel() == 0:
        return OutputDiff(name, engine, "tensor", True, tol, layer=layer, point=point)
    scale = float(a.abs().max()) or 1.0
    flat = int(diff.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    max_abs = float(diff.max())
    if max_abs == 0.0:
        where = None
    rel_all = (diff / scale).flatten().float()
    if rel_all.numel() > 1_000_000:  # quantiles of a large tensor from an even subsample
        rel_all = rel_all[:: rel_all.numel() // 1_000_000 + 1]
    position = where[1] if where is not None and address is not None and len(where) >= 2 else None
    rel = max_abs / scale
    nan = bool(torch.isnan(diff).any())
    return OutputDiff(name, engine, "tensor", (rel <= tol) and not nan, tol, max_abs=max_abs, rel=rel,
                      p50=float(rel_all.quantile(0.5)), p99=float(rel_all.quantile(0.99)), where=where,
                      position=position, layer=layer, point=point,
                      detail="NaN in one engine's output" if nan else "")


def _token_diff(name: str, engine: str, ref: _Tokens, other: _Tokens, tol: float) -> OutputDiff:
    n = min(len(ref.ids), len(other.ids))
    step = next((i for i in range(n) if ref.ids[i] != other.ids[i]), None)
    if step is None:
        if len(ref.ids) == len(other.ids):
            return OutputDiff(name, engine, "tokens", True, tol)
        return OutputDiff(name, engine, "tokens", False, tol, first_divergence=n,
                          detail=f"lengths differ: {len(ref.ids)} vs {len(other.ids)} tokens (equal up to {n})")
    pair = (ref.ids[step], other.ids[step])
    tie = None
    if ref.logprobs is not None and ref.logprobs[step]:
        top = {d["token_id"]: d["logprob"] for d in ref.logprobs[step]}
        tie = pair[1] in top and abs(top[pair[0]] - top[pair[1]]) <= tol if pair[0] in top else False
    return OutputDiff(name, engine, "tokens", bool(tie), tol, first_divergence=step, tokens=pair, near_tie=tie)


def _names(models: Sequence[Model] | Mapping[str, Model]) -> tuple[list[str], list[Model]]:
    if isinstance(models, Mapping):
        return [str(k) for k in models], list(models.values())
    models = list(models)
    names: list[str] = []
    for m in models:
        base = m.backend_name if len({x.dtype for x in models}) == 1 else \
            f"{m.backend_name}-{str(m.dtype).removeprefix('torch.')}"
        name, i = base, 2
        while name in names:
            name, i = f"{base}#{i}", i + 1
        names.append(name)
    return names, models


def compare(fn: Callable[[Model], Any], models: Sequence[Model] | Mapping[str, Model], *,
            tolerance: float | None = None) -> CompareReport:
    """Run ``fn(model)`` on each of ``models`` (two or more loaded models of the same weights,
    on different backends or dtypes; a dict names them) and compare every output against the
    first model's. ``tolerance`` (scale-relative) defaults to ``default_tolerance`` for the
    least precise dtype among the models. Returns a CompareReport (print it for a table)."""
    if not callable(fn):
        raise TypeError(f"compare takes a function of a model first, got {type(fn).__name__}")
    names, loaded = _names(models)
    if len(loaded) < 2:
        raise ValueError(f"compare needs two or more models, got {len(loaded)}")
    for m in loaded:
        if not isinstance(m, Model):
            raise TypeError(f"compare takes loaded Models (load_model), got {type(m).__name__}")
    ref_graph = loaded[0].graph
    for name, m in zip(names[1:], loaded[1:]):
        g = m.graph
        sizes = lambda x: (x.arch, x.n_layers, x.d_model, x.d_vocab, x.n_heads, x.d_mlp, x.n_experts)
        if sizes(g) != sizes(ref_graph):
            raise ValueError(f"{name} is not the same model as {names[0]}: (arch, n_layers, d_model, d_vocab, "
                             f"n_heads, d_mlp, n_experts) {sizes(g)} vs {sizes(ref_graph)}")
    dtype = max((m.dtype for m in loaded), key=lambda d: torch.finfo(d).eps)
    if tolerance is None:
        width = max(ref_graph.d_model, ref_graph.d_mlp or 0, ref_graph.n_heads * ref_graph.d_head)
        tolerance = default_tolerance(dtype, ref_graph.n_layers, width)
    elif isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance >= 0:
        raise ValueError(f"tolerance must be a number >= 0, got {tolerance!r}")
    flat = []
    for m in loaded:
        out: dict[str, Any] = {}
        layers: dict[str, Address] = {}
        _flatten(fn(m), "", out, layers)
        flat.append((out, layers))
    ref, ref_layers = flat[0]
    diffs = []
    for name, (out, _) in zip(names[1:], flat[1:]):
        if sorted(out) != sorted(ref):
            raise ValueError(f"the pipeline returned different outputs on {name} and {names[0]}: "
                             f"{sorted(set(out) ^ set(ref))} only in one")
        cut = _divergences(ref, out, float(tolerance))
        for key, value in ref.items():
            other = out[key]
            if isinstance(value, _Tokens):
                diffs.append(_token_diff(key, name, value, other, float(tolerance)))
            else:
                a, b = value, other
                note = ""
                if key in cut:  # per-step values after the tokens diverged compare different prefixes
                    a, b = a[:cut[key]], b[:cut[key]]
                    note = f"steps before {cut[key]} only (the tokens diverge there)"
                d = _tensor_diff(key, name, a, b, float(tolerance), ref_layers.get(key))
                diffs.append(replace(d, note=note) if note else d)
    return CompareReport(names[0], tuple(names), dtype, float(tolerance), tuple(diffs))


def _divergences(ref: dict, out: dict, tol: float) -> dict[str, int]:
    """For each ``.../logprob`` series, the step where its tokens first diverged."""
    cut = {}
    for key, value in ref.items():
        if isinstance(value, _Tokens):
            d = _token_diff(key, "", value, out[key], tol)
            if d.first_divergence is not None:
                cut[key[: -len("tokens")] + "logprob"] = d.first_divergence
    return cut


def assert_backends_agree(fn: Callable[[Model], Any], models: Sequence[Model] | Mapping[str, Model], *,
                          tolerance: float | None = None) -> CompareReport:
    """For a user's pytest: ``compare`` and raise AssertionError with the failing rows (and
    the full table) when any output differs by more than the tolerance. Returns the report."""
    report = compare(fn, models, tolerance=tolerance)
    if not report.passed:
        lines = [f"  {d.output} on {d.engine}: {d.describe()}" for d in report.failures()]
        raise AssertionError(f"backends disagree on {len(lines)} output(s):\n" + "\n".join(lines)
                             + "\n\n" + report.table())
    return report
