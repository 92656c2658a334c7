"""Real models and what FSDP2 users rely on, at 2 gloo ranks against single-process references of the same global
batches: unmodified Hugging Face `transformers` models (Llama-style and GPT-2, tied embeddings, the model's own
loss), graph breaks, sequence lengths changing between steps, and clear errors for bad input.

The training jobs run in one spawn of 2 ranks (cached); each test asserts on its job's result.
"""

from __future__ import annotations

import functools

import pytest
import torch
from harness import run_ranks
from real_model_workers import (
    CHANGING_SEQS,
    SEQ,
    BranchyNet,
    bad_input,
    branchy_batch,
    branchy_reference,
    hf_model,
    hf_reference,
    training_jobs,
)

STEPS = 5
# tests/test_training.py's tolerances: AdamW's steps on entries whose gradient is ~0 are lr-sized in a direction set
# by rounding, so runs that only sum in another order differ there by up to ~1e-4
PARAM_RTOL, PARAM_ATOL = 1e-4, 3e-4
BRANCHY_STEPS = 4
JOBS = {
    "llama": ("hf_training", ("llama", (SEQ,) * STEPS)),
    "gpt2": ("hf_training", ("gpt2", (SEQ,) * STEPS)),
    "llama_changing_seq": ("hf_training", ("llama", CHANGING_SEQS)),
    "branchy": ("branchy_training", (BRANCHY_STEPS,)),
}


@functools.cache
def ranks() -> list[dict]:
    return run_ranks(training_jobs, 2, JOBS, timeout=600)


def result(job: str) -> dict:
    """Rank 0's result of `job` (a rank that raised fails the test with its traceback)."""
    for r in ranks():
        assert isinstance(r[job], dict), r[job]
    return ranks()[0][job]


def assert_all_close(got: dict, expected: dict, rtol: float, atol: float) -> None:
    assert got.keys() == expected.keys()
    for k, value in expected.items():
        torch.testing.assert_close(got[k], value, rtol=rtol, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


def assert_trained_like(result: dict, ref: dict, init: dict) -> None:
    """Losses of every step, first-step gradients and final parameters match the single-process reference."""
    torch.testing.assert_close(result["losses"], ref["losses"], rtol=1e-5, atol=0)
    # gradients are ~1e-3 here; a missing or doubled average over ranks would be off by 2x
    assert_all_close(result["grads"], ref["grads"], rtol=1e-4, atol=1e-6)
    assert_all_close(result["params"], ref["params"], PARAM_RTOL, PARAM_ATOL)
    # and the steps moved the parameters by much more than the tolerance, so the comparison can tell
    moved = max((ref["params"][k] - init[k]).abs().max().item() for k in init)
    assert moved > 100 * PARAM_ATOL, moved


def initial_params(model: torch.nn.Module) -> dict:
    return {k: p.detach().clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_transformers_model_trains_like_a_single_process(name):
    model, _ = hf_model(name)
    cfg = model.config
    assert cfg._attn_implementation == "sdpa" and cfg.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if name == "llama":  # grouped-query attention: fewer key/value heads than query heads
        attn = model.model.layers[0].self_attn
        assert attn.k_proj.out_features < attn.q_proj.out_features
    ref = hf_reference(name, (SEQ,) * STEPS)
    res = result(name)
    assert res["tied_after_shard"]  # one sharded parameter for embedding and head
    assert res["params"].keys() == ref["params"].keys()  # the tied head is not a second parameter
    assert_trained_like(res, ref, initial_params(model))
    assert res["losses"][-1] < res["losses"][0] - 0.5  # it learns the next-token rule
    # every rank computed the same averaged losses
    assert all(r[name]["losses"] == res["losses"] for r in ranks())


def _plain_graph_count(model: torch.nn.Module, steps: int) -> int:
    """How many graphs Dynamo captures from the unsharded model over the same steps (a counting backend)."""
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=count)
    for step in range(steps):
        x, y = branchy_batch(step)
        torch.nn.functional.mse_loss(compiled(x), y).backward()
    torch._dynamo.reset()
    return len(graphs)


def test_graph_breaks_train_correctly_and_are_counted():
    res = result("branchy")
    assert_trained_like(res, branchy_reference(BRANCHY_STEPS), initial_params(BranchyNet()))
    # subgraphs: before the print, after it up to the branch, and each branch's continuation (both taken)
    expected = _plain_graph_count(BranchyNet(), BRANCHY_STEPS)
    assert expected == 4
    counts = res["counts"]
    assert (counts.forward, counts.backward, counts.frames, counts.recompiles) == (expected, expected, expected, 0)
    # fc1 is read on both sides of the print: gathered in two forward graphs, its gradient reduced in two backward
    # graphs (and the two halves summed into one sharded .grad: the parity above)
    for kind, collective in (("forward", "all_gather"), ("backward", "reduce_scatter")):
        graphs = [g for g in res["graphs"] if g["kind"] == kind]
        serving_fc1 = [g for g in graphs if any(c == collective and "fc1.weight" in p for c, p in g["collectives"])]
        assert len(serving_fc1) == 2, (kind, [g["collectives"] for g in graphs])


def test_changing_sequence_length_matches_step_by_step_with_one_dynamic_recompile():
    res = result("llama_changing_seq")
    model, _ = hf_model("llama")
    assert_trained_like(res, hf_reference("llama", CHANGING_SEQS), initial_params(model))
    counts = res["counts"]
    # the first call compiles for its static shape, the first new length recompiles once with a symbolic length,
    # which serves every later length
    assert (counts.forward, counts.backward, counts.frames, counts.recompiles) == (2, 2, 1, 1)
    first, second = [g for g in res["graphs"] if g["kind"] == "forward"]
    assert first["symbolic"] == [] and second["symbolic"], second["symbolic"]
    # the passes received symbolic sizes: the final graphs of both directions still carry them, and the lowered
    # collectives are in them
    for g in res["graphs"]:
        if g["compile_id"] == second["compile_id"]:
            assert g["symbolic"] and any(c == "all_gather" for c, _ in g["collectives"]), g


@functools.cache
def bad_input_messages() -> list[dict[str, str]]:
    return run_ranks(bad_input, 2, timeout=600)


@pytest.mark.parametrize(
    "case, words",
    [
        ("meta_input", ["input args[0]", "device 'meta'", "parameters are on 'cpu'", "args[0].to('cpu')"]),
        ("meta_kwarg", ["input kwargs['extra']", "device 'meta'", ".to('cpu')"]),
        ("meta_backend", ["input L['extra']", "device 'meta'", ".to('cpu')"]),
    ],
)
def test_input_on_the_wrong_device_is_named(case, words):
    for messages in bad_input_messages():
        assert messages[case].startswith(("ValueError", "BackendCompilerFailed")), messages[case]
        for word in words:
            assert word in messages[case], messages[case]
        assert messages["good_input_after_errors"] == "ok"


@pytest.mark.parametrize(
    "case, name",
    [
        ("replaced_before_compile", "fc.weight"),
        ("replaced_after_compile", "fc2.weight"),
        ("replaced_eager", "fc.weight"),
    ],
)
def test_parameter_replaced_after_shard_is_named(case, name):
    for messages in bad_input_messages():
        assert messages[case].startswith("TypeError"), messages[case]
        assert (
            f"parameter '{name}' was replaced" in messages[case]
            and "before calling fsdp2_compile.shard" in messages[case]
        )


def test_parameter_used_on_one_rank_only_fails_on_every_rank_naming_it():
    for messages in bad_input_messages():
        message = messages["rank_zero_only"]
        assert "compiled different forward schedules" in message, message
        assert "all_gather of extra.bias, extra.weight on rank 0 only" in message, message
