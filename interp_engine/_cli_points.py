"""The points this model has, with their shapes, and whether the chosen backend serves each one:
a refused point names the capability it needs, why it is missing, and what to use instead.
Answered from the configuration; no forward runs."""

from __future__ import annotations

import argparse

from ._cli_common import add_model_arguments, load

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)


def run(args: argparse.Namespace) -> int:
    from ._address import Address
    from ._plan import capture_plan

    model = load(args)
    print(f"{model.graph.describe()} on backend {model.backend_name!r}")
    for point in model.points():
        layers = model.graph.layers_of(point.name)
        address = Address(point.name, layers[0])
        refusal = model.backend.refusal(capture_plan(model.graph, [address]), None)
        span = f"layers {layers[0]}..{layers[-1]}" if len(layers) > 1 else f"layer {layers[0]}"
        shape = "[" + ", ".join(point.dims) + "]"
        verdict = "served" if refusal is None else f"refused: {refusal}"
        print(f"  {point.name:<15} {shape:<34} {span:<14} {verdict}")
    return 0
