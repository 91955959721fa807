"""Whether a candidate draft may replace the current one: its validation passed and, where both were
served by vLLM, its acceptance length did not drop by more than the share allowed."""

from __future__ import annotations

from tasks.registry.layout import Version


def measured(report: dict) -> tuple[float | None, int | None, list[float]]:
    """From a validation report (tasks/validate/stage.py): vLLM's mean acceptance length, the k it was
    measured with and its per-position acceptance; None, None, [] where vLLM did not serve the draft."""
    live = report.get("live") or {}
    draft = live.get("draft") or {}
    return draft.get("mean_acceptance_length"), live.get("num_speculative_tokens"), draft.get(
        "per_position_acceptance", [])


def validation_verdict(report: dict) -> tuple[bool, str]:
    """Whether the report says the draft passed validation, and in words. Static checks failing are
    in the report; so are the live checks' where it records them (`passed`)."""
    static = report.get("static") or {}
    if not static.get("ok"):
        return False, "validation failed its static checks: " + ("; ".join(static.get("errors", [])) or "see report.md")
    if report.get("passed") is False:
        return False, "validation failed its vLLM checks (report.md says why)"
    tau, k, _ = measured(report)
    if tau is None:
        return True, "validation passed (static checks; vLLM did not serve the draft)"
    return True, f"validation passed (static checks; vLLM served it: τ {tau:.3f} at k={k})"


def gate(candidate_report: dict, current: Version | None, max_regression: float) -> tuple[bool, str]:
    """(ok, why): validation passed and, where both have a vLLM-measured τ, the candidate's is at least
    the current version's × (1 - max_regression)."""
    ok, why = validation_verdict(candidate_report)
    if not ok:
        return False, why
    if current is None:
        return True, f"{why}; no current version to compare with"
    tau, k, _ = measured(candidate_report)
    if tau is None or current.tau is None:
        missing = "the candidate" if tau is None else f"version {current.number}"
        return True, f"{why}; τ not compared: {missing} has no vLLM measurement"
    floor = current.tau * (1 - max_regression)
    unlike = (f" (measured with k={k} against k={current.measured_k}: not like for like)"
              if k != current.measured_k else "")
    comparison = (f"τ {tau:.3f} against version {current.number}'s {current.tau:.3f}, at least {floor:.3f} "
                  f"allowed (a drop of at most {max_regression:.0%}){unlike}")
    if tau >= floor:
        return True, f"{why}; {comparison}"
    return False, f"τ regressed: {comparison}"
