"""Hypothesis profiles, chosen by INTERP_ENGINE_HYPOTHESIS_PROFILE:
  quick     (default; the README test command and CI): few examples, derandomized, no deadline
  thorough  many examples, random seeds, for a long run
  mutation  tests/test_mutation.py: the quick profile's examples, no shrinking, no database
            (a planted bug only has to be caught, and its failures must not be replayed later)
Failures print the reproducing example (and its @reproduce_failure blob)."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

_COMMON = dict(deadline=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                      HealthCheck.data_too_large])
settings.register_profile("quick", max_examples=8, derandomize=True,
                          phases=[Phase.explicit, Phase.generate, Phase.target, Phase.shrink], **_COMMON)
settings.register_profile("mutation", max_examples=8, derandomize=True, database=None,
                          phases=[Phase.explicit, Phase.generate], **_COMMON)
settings.register_profile("thorough", max_examples=200, **_COMMON)
settings.load_profile(os.environ.get("INTERP_ENGINE_HYPOTHESIS_PROFILE", "quick"))
