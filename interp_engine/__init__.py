"""interp_engine: mechanistic interpretability on eager transformers and inside vLLM, with one API.

Public names are re-exported here explicitly from small private modules.
"""

from ._address import Address, format_address, parse_address, to_address
from ._backend import Backend, RawStep
from ._api import (
    Completion,
    GenStep,
    active_steering,
    capture_generation,
    decode_residuals,
    expert_assignment,
    generate_stream,
    head_contributions,
    run,
    run_with_cache,
    steer,
)
from ._cache import Cache
from ._compare import CompareReport, OutputDiff, assert_backends_agree, compare, default_tolerance
from ._capabilities import CAPABILITIES, Capability, CapabilityUnsupported
from ._harvest import HarvestReport, harvest
from ._harvest_ray import harvest_ray
from ._graph import GradSupport, ModelGraph, ResidualBasis
from ._model import Model, ModelNotFound, Tokenizer, load_model
from ._plan import Plan, SteerOp, SteerSpec, capture_plan, steer_plan
from ._points import POINTS, PointSpec
from ._steered import SteeredModel, steered
from ._sampling import SAMPLING_FIELDS, SamplingConfig, top_logprobs
from ._shapes import DIMS, ShapeError
from ._tl import TL_HOOKS, from_tl
from ._tokens import TokenBatch

__all__ = [
    "Address", "Backend", "CAPABILITIES", "CompareReport", "OutputDiff", "assert_backends_agree", "compare",
    "default_tolerance", "DIMS", "RawStep", "SAMPLING_FIELDS", "ShapeError", "Cache", "Capability", "CapabilityUnsupported", "Completion",
    "GenStep", "GradSupport", "HarvestReport", "harvest", "harvest_ray", "Model", "ModelGraph", "ModelNotFound", "POINTS", "Plan",
    "PointSpec", "ResidualBasis", "SamplingConfig", "SteerOp", "SteerSpec", "TokenBatch",
    "Tokenizer", "active_steering", "capture_generation", "capture_plan", "decode_residuals",
    "expert_assignment", "format_address", "from_tl", "TL_HOOKS", "generate_stream", "head_contributions",
    "load_model", "parse_address", "run", "run_with_cache", "steer", "steer_plan", "steered", "SteeredModel",
    "to_address",
    "top_logprobs",
]

__version__ = "0.1.0"
