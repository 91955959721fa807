"""The serve line: k chosen from vLLM's per-position acceptance under the stated cost model, and a
command that a shell splits into `vllm serve VERIFIER --speculative-config JSON`."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest

from tasks.validate.serve_line import (
    K_RANGE,
    conditional_acceptance,
    draft_step_cost,
    engine_arguments,
    expected_tokens,
    serve_lines,
    weight_bytes,
)
from tests.hub_cache import lay_out_repo


def serve_engine_arguments(command: str) -> dict:
    """The engine arguments a shell gives vLLM for `command` (`vllm serve ...`), as vLLM's own CLI reads
    them: its `serve` parser (built as vllm's main builds it), then AsyncEngineArgs.from_cli_args; the
    fields the command's arguments change from a bare `vllm serve`'s."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    def engine_args(argv: list[str]):
        parser = FlexibleArgumentParser(prog="vllm")
        serve = ServeSubcommand()
        serve.subparser_init(parser.add_subparsers(dest="subparser"))
        args = parser.parse_args(argv)
        if args.model_tag is not None:  # the positional model wins, as ServeSubcommand.cmd has it
            args.model = args.model_tag
        serve.validate(args)
        return AsyncEngineArgs.from_cli_args(args)

    argv = shlex.split(command)  # exactly as a shell splits it
    assert argv[:2] == ["vllm", "serve"], command
    given, bare = engine_args(argv[1:]), engine_args(["serve"])
    return {f.name: getattr(given, f.name) for f in dataclasses.fields(given)
            if getattr(given, f.name) != getattr(bare, f.name)}


@pytest.fixture(scope="module")
def draft(drafts):
    return str(drafts[0][0])


def test_expected_tokens_at_the_measured_k_is_vllms_mean_acceptance_length():
    per_position = [0.7, 0.45, 0.25]  # shares of drafts whose first 1, 2, 3 tokens were all accepted
    assert expected_tokens(per_position, 3) == pytest.approx(1 + sum(per_position))
    assert expected_tokens(per_position, 1) == pytest.approx(1 + per_position[0])
    last = conditional_acceptance(per_position)[-1]
    assert last == pytest.approx(0.25 / 0.45)
    # beyond the measured positions, each further token is accepted at the last conditional rate
    assert expected_tokens(per_position, 5) == pytest.approx(1 + sum(per_position) + 0.25 * last + 0.25 * last ** 2)


def test_the_draft_costs_its_weights_share_of_a_verifier_step(smollm2, draft):
    cost, how = draft_step_cost(smollm2, draft)
    draft_all, draft_read = weight_bytes(draft), weight_bytes(draft, ("embed_tokens",))
    assert draft_read < draft_all  # the token embedding, a lookup, is left out
    assert cost == pytest.approx(draft_read / weight_bytes(smollm2))
    assert f"{cost:.3f}" in how
    hub_cost, hub_how = draft_step_cost("HuggingFaceTB/SmolLM2-135M-Instruct", draft)
    assert hub_cost == 0.05 and "assumed" in hub_how


@pytest.mark.parametrize("per_position", [[0.95, 0.9, 0.85], [0.6, 0.3, 0.12], [0.05, 0.002]])
def test_k_maximizes_expected_tokens_per_unit_of_cost(smollm2, draft, per_position):
    line = serve_lines(smollm2, draft, per_position)
    cost, _ = draft_step_cost(smollm2, draft)
    per_cost = {k: expected_tokens(per_position, k) / (1 + k * cost) for k in K_RANGE}
    assert per_cost[line.k] == max(per_cost.values())
    figures = ", ".join(f"{expected_tokens(per_position, k):.2f}" for k in K_RANGE)
    assert line.why.startswith(f"k={line.k}: ") and figures in line.why and "\n" not in line.why


def test_high_acceptance_drafts_more_tokens_than_low(smollm2, draft):
    assert serve_lines(smollm2, draft, [0.95, 0.9, 0.85]).k == max(K_RANGE)
    assert serve_lines(smollm2, draft, [0.05, 0.002]).k == min(K_RANGE)


def test_the_command_splits_into_vllm_serve_arguments_and_the_python_form_evaluates(smollm2, draft):
    line = serve_lines(smollm2, draft, [0.6, 0.3, 0.12], trust_remote_code=True)
    args = shlex.split(line.command)
    assert args[:3] == ["vllm", "serve", smollm2] and args[3] == "--speculative-config"
    assert json.loads(args[4]) == {"model": draft, "num_speculative_tokens": line.k, "method": "eagle3"}
    assert args[5:] == ["--trust-remote-code"]
    captured = {}
    eval(line.python, {"LLM": lambda **kwargs: captured.update(kwargs)})  # the form as vLLM's LLM receives it
    assert captured == {"model": smollm2, "speculative_config": json.loads(args[4]), "trust_remote_code": True}


def test_without_a_measurement_the_default_k_is_said(smollm2, draft):
    line = serve_lines(smollm2, draft, [])
    assert json.loads(shlex.split(line.command)[4])["num_speculative_tokens"] == line.k
    assert "no per-position acceptance measured" in line.why


def test_vllms_own_parser_reads_the_command_as_the_python_form_says(smollm2, draft, tmp_path):
    """A local verifier and a Hub id's snapshot (served by its id, pinned to its commit): vLLM's `serve`
    parser turns the shell line into exactly the engine arguments LLM(...) is given, which are the ones
    validation's engines start with (engine_arguments). tests/validate/test_vllm_live.py serves them."""
    hub_id = "HuggingFaceTB/SmolLM2-135M-Instruct"
    snapshot = lay_out_repo(tmp_path / "hub", "model", hub_id,
                            {name: (Path(smollm2) / name).read_bytes() for name in ("config.json", "tokenizer.json")})
    commit = snapshot.name
    for verifier, trust, model, revision in [(smollm2, True, smollm2, None), (str(snapshot), False, hub_id, commit)]:
        line = serve_lines(verifier, draft, [0.6, 0.3, 0.12], trust_remote_code=trust)
        captured = {}
        eval(line.python, {"LLM": lambda **kwargs: captured.update(kwargs)})
        expected = engine_arguments(model, draft, line.k, revision=revision, trust_remote_code=trust)
        assert serve_engine_arguments(line.command) == captured == expected
