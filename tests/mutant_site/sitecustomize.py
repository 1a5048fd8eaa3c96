"""Test-only (tests/test_mutation.py): with this folder on PYTHONPATH and a mutant named by
INTERP_ENGINE_MUTANT_FILE or INTERP_ENGINE_MUTANT, every Python process, vLLM's workers
included, imports interp_engine with the planted-bug wrappers of interp_mutants in place."""

import os

if os.environ.get("INTERP_ENGINE_MUTANT_FILE") or os.environ.get("INTERP_ENGINE_MUTANT"):
    import interp_mutants

    interp_mutants.install()
