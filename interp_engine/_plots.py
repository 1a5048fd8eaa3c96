"""Pictures with matplotlib (imported here only, on first use): the logit-lens heatmap and the
attention-pattern grid. Each function writes one PNG and returns its path."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence

import torch

__all__ = ["attention_png", "lens_png"]


def _pyplot():
    try:
        import matplotlib
    except ImportError as exc:  # an install without the plotting dependency
        raise ModuleNotFoundError("pictures need matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _label(text: str) -> str:
    """A token as a readable cell label: visible spaces and newlines, at most 10 characters."""
    shown = text.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "\u2423")
    shown = "".join(ch if ch.isprintable() else f"\\x{ord(ch):02x}" for ch in shown)
    return shown if len(shown) <= 10 else shown[:9] + "\u2026"


def lens_png(path: str | pathlib.Path, probs: torch.Tensor, tokens: Sequence[Sequence[str]],
             row_labels: Sequence[str], col_labels: Sequence[str], title: str) -> pathlib.Path:
    """Heatmap ``probs [layer, pos]`` (probability of each cell's top token), the top token and
    its probability written in every cell; layers run bottom (embeddings) to top (output)."""
    plt = _pyplot()
    n_rows, n_cols = probs.shape
    fig, ax = plt.subplots(figsize=(1.25 * n_cols + 2.0, 0.62 * n_rows + 1.6))
    image = ax.imshow(probs.float().numpy(), cmap="Blues", vmin=0.0, vmax=1.0, origin="lower",
                      aspect="auto")
    for r in range(n_rows):
        for c in range(n_cols):
            p = float(probs[r, c])
            ax.text(c, r, f"{_label(tokens[r][c])}\n{p:.2f}", ha="center", va="center", fontsize=8,
                    color="white" if p > 0.55 else "black")
    ax.set_xticks(range(n_cols), [_label(t) for t in col_labels], rotation=30, ha="right", fontsize=8)
    ax.set_yticks(range(n_rows), list(row_labels), fontsize=8)
    ax.set_xlabel("input position (token)")
    ax.set_ylabel("layer")
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02, label="probability of the top token")
    fig.tight_layout()
    out = pathlib.Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def attention_png(path: str | pathlib.Path, pattern: torch.Tensor, labels: Sequence[str],
                  title: str) -> pathlib.Path:
    """One small heatmap per head from ``pattern [n_heads, query_pos, key_pos]``."""
    plt = _pyplot()
    n_heads, n_pos = pattern.shape[0], pattern.shape[-1]
    cols = min(n_heads, 4)
    rows = math.ceil(n_heads / cols)
    side = max(2.6, 0.32 * n_pos + 1.2)
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols, side * rows + 0.6), squeeze=False)
    ticks = [_label(t) for t in labels]
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= n_heads:
            ax.axis("off")
            continue
        ax.imshow(pattern[h].float().numpy(), cmap="viridis", vmin=0.0, vmax=1.0)
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xticks(range(n_pos), ticks, rotation=90, fontsize=7)
        ax.set_yticks(range(n_pos), ticks, fontsize=7)
        if h % cols == 0:
            ax.set_ylabel("query position", fontsize=8)
        ax.set_xlabel("key position", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out = pathlib.Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
