"""Every law (property_tests/test_laws.py) and every spec-page example
(tests/test_spec_examples.py) fails on a planted bug.

The bugs live in tests/mutant_site/interp_mutants.py: the op math (add a no-op, ablate the
identity, set ignoring its positions, a scaled add, scale ignored), the position selection (off
by one), the capture copy (scaled, from the neighbouring layer, written back into the stream,
stale at decode steps), the steering context, the data transforms, vLLM's rebuilt attention
pattern (no causal mask, no soft-cap, tiled GQA heads, a window one key too wide, no sinks) and the
experts= write (a no-op). A subprocess runs the tests below with that folder on PYTHONPATH, so
its sitecustomize installs the wrappers in the pytest process and in vLLM's engine and worker
processes; the mutant_plugin runs each test as written and then under each of its mutants (one
engine for all runs) and reports the outcomes. Each test must pass as written and fail under every mutant listed for it.

``bug@vllm`` / ``bug@eager`` plants the bug in one backend's code only: the laws that compare
the backends catch those. The smallest subsets that prove the point: the tiny Qwen3 (Qwen3-MoE
for routing), eager and vLLM, the quick Hypothesis examples without shrinking.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "tests" / "mutant_site"
L = "property_tests/test_laws.py"
S = "tests/test_spec_examples.py"
has_vllm = importlib.util.find_spec("vllm") is not None

# test -> the planted bugs it must catch
EAGER: dict[str, list[str]] = {
    f"{L}::test_capture_never_changes_outputs[qwen3-eager]": ["capture_writes_stream"],
    f"{L}::test_steering_at_scale_zero_is_the_identity_and_nonzero_steering_is_not[qwen3-eager]":
        ["add_noop", "scale_ignored"],
    f"{L}::test_nested_blocks_equal_one_composed_spec_and_unsteer_restores[qwen3]":
        ["nested_inner_only", "write_noop"],
    f"{L}::test_exception_inside_steer_restores_exactly": ["steer_exit_leaks", "add_noop"],
    f"{L}::test_lens_at_the_last_layer_equals_the_logits[qwen3]": ["capture_wrong_layer", "lens_skips_norm"],
    f"{L}::test_expert_assignment_is_the_routers_selection[qwen3_moe]": ["expert_weights_dropped"],
    f"{L}::test_expert_writes_agree_with_eager_scale_one_is_the_identity_and_zero_is_not[qwen3_moe-eager]":
        ["expert_write_noop"],
    f"{L}::test_capture_generation_rows_are_a_forward_over_prompt_and_generated[qwen3-eager]":
        ["capture_stale_decode"],
    f"{L}::test_deltas_join_to_the_text_and_seeded_sampling_repeats[qwen3-eager]": ["stream_drops_last_delta"],
    f"{L}::test_transforms_never_mutate_their_inputs[qwen3]": ["spec_aliases_caller_vector"],
    f"{L}::test_address_parse_format_round_trips": ["format_drops_stream"],
    f"{L}::test_every_invalid_address_string_raises": ["parse_error_unnamed"],
    f"{L}::test_vllm_static_refuses_points_it_cannot_compile_in_by_name": ["static_refused_unnamed"],
    f"{S}::test_capture_page[eager]": ["capture_scaled", "capture_wrong_layer"],
    f"{S}::test_capture_while_generating[eager]": ["capture_stale_decode", "capture_scaled"],
    f"{S}::test_batch_moe_heads_and_gradients_on_eager": ["expert_weights_dropped", "capture_scaled"],
    f"{S}::test_capabilities_page": ["static_refused_unnamed"],
    f"{S}::test_generation_page[eager]": ["stream_drops_last_delta"],
    f"{S}::test_steering_page[eager]": ["add_noop", "ablate_identity", "set_ignores_positions", "add_scaled",
                                        "scale_ignored", "positions_off_by_one", "nested_inner_only"],
    f"{S}::test_logit_lens_page[eager]": ["capture_wrong_layer", "lens_skips_norm"],
    f"{S}::test_free_lens_and_where_it_does_not_apply": ["lens_skips_norm"],
}

VLLM: dict[str, list[str]] = {
    f"{L}::test_backends_agree_on_every_served_point[qwen3]": ["capture_scaled@vllm"],
    f"{L}::test_backends_agree_on_greedy_tokens_logprobs_and_steering[qwen3]":
        ["add_noop@vllm", "ablate_identity@vllm", "positions_off_by_one@vllm"],
    f"{L}::test_capture_generation_rows_equal_across_backends[qwen3]": ["capture_stale_decode@vllm"],
    f"{L}::test_capture_never_changes_outputs[qwen3-vllm]": ["capture_writes_stream"],
    f"{L}::test_steering_at_scale_zero_is_the_identity_and_nonzero_steering_is_not[qwen3-vllm]":
        ["add_noop", "scale_ignored"],
    f"{L}::test_lens_at_the_last_layer_equals_the_logprobs_on_vllm[qwen3-vllm]": ["capture_wrong_layer"],
    f"{L}::test_capture_generation_rows_are_a_forward_over_prompt_and_generated[qwen3-vllm]":
        ["capture_stale_decode"],
    f"{L}::test_deltas_join_to_the_text_and_seeded_sampling_repeats[qwen3-vllm]": ["stream_drops_last_delta"],
    f"{L}::test_refusals_happen_exactly_where_the_table_says[qwen3-vllm]": ["refusal_dropped"],
    f"{L}::test_expert_writes_agree_with_eager_scale_one_is_the_identity_and_zero_is_not[qwen3_moe-vllm]":
        ["expert_write_noop", "expert_write_noop@vllm"],
    f"{S}::test_capture_page[vllm]": ["capture_scaled", "capture_wrong_layer"],
    f"{S}::test_capture_while_generating[vllm]": ["capture_stale_decode", "capture_scaled"],
    f"{S}::test_generation_page[vllm]": ["stream_drops_last_delta"],
    f"{S}::test_steering_page[vllm]": ["add_noop", "ablate_identity", "set_ignores_positions", "add_scaled",
                                       "scale_ignored", "positions_off_by_one", "nested_inner_only"],
    f"{S}::test_logit_lens_page[vllm]": ["capture_wrong_layer"],
    f"{S}::test_from_embeddings_page": ["embed_scaled"],
    "tests/bridge/vllm/test_routing.py::test_selection_equals_eager_at_prompt_and_generated_positions[qwen3_moe]":
        ["route_not_renormalised", "route_unsorted"],
    # Gemma 2 has GQA, a window shorter than the prompt and soft-capping; GPT-OSS has the sinks
    "tests/bridge/vllm/test_internals.py::test_pattern_equals_eager_and_hf_on_prompt_and_generated_rows[gemma2]":
        ["pattern_no_causal_mask", "pattern_no_softcap", "pattern_gqa_tiled", "pattern_window_off_by_one"],
    "tests/bridge/vllm/test_internals.py::test_pattern_equals_eager_and_hf_on_prompt_and_generated_rows[gpt_oss]":
        ["pattern_sinks_dropped"],
}


def _mutant_names() -> set[str]:
    sys.path.insert(0, str(SITE))
    try:
        import interp_mutants
    finally:
        sys.path.remove(str(SITE))
    return set(interp_mutants.MUTANTS)


def _test_functions(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_law_example_and_planted_bug_is_in_the_table():
    """No law or example without a bug it must catch; no planted bug that nothing catches."""
    planned = {nodeid.split("::")[1].split("[")[0] for nodeid in {**EAGER, **VLLM}}
    for path in (L, S):
        missing = _test_functions(path) - planned
        assert not missing, f"{path}: tests with no planted bug to catch: {sorted(missing)}"
    caught = {m.partition("@")[0] for table in (EAGER, VLLM) for ms in table.values() for m in ms}
    assert caught == _mutant_names(), f"planted bugs nothing is checked against: {_mutant_names() - caught}"


def _run(plan: dict[str, list[str]], tmp_path: Path) -> dict[str, dict[str, str]]:
    plan_file, report_file = tmp_path / "plan.json", tmp_path / "report.json"
    plan_file.write_text(json.dumps(plan))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["INTERP_ENGINE_MUTANT_FILE"] = str(tmp_path / "mutant")
    env["INTERP_ENGINE_HYPOTHESIS_PROFILE"] = "mutation"
    env.pop("INTERP_ENGINE_MUTANT", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "mutant_plugin", "-p", "no:cacheprovider",
           "--mutant-plan", str(plan_file), "--mutant-report", str(report_file), *plan]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert report_file.exists(), f"the mutation run wrote no report:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    report = json.loads(report_file.read_text())
    missed = []
    for nodeid, mutants in plan.items():
        outcomes = report.get(nodeid)
        if outcomes is None:
            missed.append(f"{nodeid}: did not run")
            continue
        if outcomes.get("none") != "passed":
            missed.append(f"{nodeid}: {outcomes.get('none')} without a mutant")
            continue
        missed += [f"{nodeid}: passed with {m} planted" for m in mutants if not outcomes[m].startswith("failed")]
    assert not missed, "\n".join(missed) + f"\n\n{done.stdout[-3000:]}"
    return report


@pytest.mark.slow
def test_eager_laws_and_examples_catch_their_planted_bugs(tmp_path):
    _run(EAGER, tmp_path)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not has_vllm, reason="vllm not installed")
def test_vllm_laws_and_examples_catch_their_planted_bugs_in_the_workers(tmp_path):
    _run(VLLM, tmp_path)
