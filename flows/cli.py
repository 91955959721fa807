"""Command line: `eagle3-pipeline run CONFIG.yaml [--set section.key=value ...]`.

`run` runs the flow in-process on Prefect's ephemeral server (no server to start). Unless
PREFECT_HOME is set, Prefect's database and result store live in `<output_dir>/.prefect`, so runs
of one output folder share a cache and nothing leaks into ~/.prefect.
`config` prints the validated config (`--json`: one line, for `prefect deployment run --param`);
`plan` sizes a run on any machine (tasks/plan.py); `prune-shards` frees stale shards; `gc` removes the
outputs no kept run references (tasks/gc.py); `verify` re-reads every file a run trusts and moves what
fails aside, for the next run to redo (tasks/scrub.py); `drafts` lists,
promotes and rolls back the versions of the draft registry (tasks/registry/).

Exit status: 0 done; 2 a problem a retry cannot fix (a bad config, a missing or empty input, an
unwritable output folder, a deterministic failure in a stage), named in one `error:` line; 1 a
stage that still failed after its retries, or for `plan`, an extraction this machine's disk or
memory could not hold; 3 the output folder is in use by another run (its process and host named);
128 + the signal's number (143 for SIGTERM, 130 for SIGINT) a run stopped by a signal, every
process it started ended and its flow run marked Cancelled (a second signal kills outright).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

import yaml

from flows.prefect_env import (
    set_aside_damaged_database,
    start_run_server,
    use_private_prefect_home,
    wait_for_run_server,
)
from flows.run_log import run_log
from flows.stop import Stopped, end_stopped_run, run_began, stop_on_signals
from tasks.common.config import ConfigError, load_config
from tasks.common.demo_assets import resolve_config
from tasks.common.errors import PermanentError, describe, is_deterministic
from tasks.common.folder_lock import FolderLockedError, folder_lock, refuse_if_busy
from tasks.common.refusals import exits_on_refusal, refusal_exit
from tasks.preflight import check_before_run, check_data, check_writable
from tasks.prepare.chat_data import source_name


def parse_overrides(items: list[str]) -> dict:
    """`a.b=1` pairs as a nested dict; values are parsed as YAML (numbers, lists, booleans)."""
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--set expects section.key=value, got {item!r}")
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        try:
            node[leaf] = yaml.safe_load(value)
        except yaml.YAMLError as e:
            problem = " ".join(str(getattr(e, "problem", None) or e).split())
            raise ConfigError(f"--set {item}: the value is not valid YAML ({problem}); quote it for the "
                              "shell, e.g. --set 'train.lr=[1, 2]'") from None
    return out


def main(argv: list[str] | None = None) -> int:
    try:
        return command(argv)
    except BrokenPipeError:  # `eagle3-pipeline config X | head`: the reader has gone, nothing to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit, when stdout is flushed
        return 0
    except Stopped as stop:  # while starting (checks, Prefect's server, imports), or after run_flow
        end_stopped_run(stop)


def command(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3-pipeline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the pipeline flow on a config file")
    show = sub.add_parser("config", help="print a config file validated, every default filled in")
    show.add_argument("--json", action="store_true", help="as one line of JSON (for `--param config=...`)")
    plan = sub.add_parser("plan", help="print the extraction plan of a config without loading the verifier "
                          "(config.json suffices; without tokenizer files a stand-in counts): tokens, disk, shards, "
                          "host memory, time; exits 1 when extraction would refuse to start on this machine (disk, "
                          "host memory)")
    plan.add_argument("--gpu-tflops", type=float,
                      help="dense bf16 TFLOP/s of the GPU the run will get, for the time estimate "
                           "(default: an H100/H200 SXM's)")
    plan.add_argument("--disk-gb-per-s", type=float,
                      help="what the output folder sustains in writes, all the run's nodes together (one node's "
                           "disk, or a shared filesystem's aggregate), for the time estimate (default: the 1.0 GB/s "
                           "measured on the H200 machine's disk)")
    plan.add_argument("--json", action="store_true", help="the plan as JSON")
    plan.add_argument("--keep", action="store_true",
                      help="keep the tokenized data under output_dir, where the run reuses it (default: nothing "
                           "is written)")
    for command in (run, show, plan):
        command.add_argument("config", help="YAML config (see deployments/)")
        command.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                             help="override a setting, e.g. --set train.epochs=2 (repeatable)")
    run.add_argument("--refresh", action="store_true",
                     help="ignore Prefect's task cache (stages still reuse valid outputs on disk)")
    prune = sub.add_parser("prune-shards", help="delete hidden-state shards no extraction manifest lists")
    prune.add_argument("folder", help="an output's hidden_states/ folder")
    prune.add_argument("--keep", metavar="MANIFEST", help="keep only this manifest's shards (and manifest)")
    verify = sub.add_parser("verify", help="re-read every file a run trusts (shards, checkpoints, the draft, "
                            "journals, vocabularies) against its checksums, move what fails aside, and say which "
                            "command repairs it; exits 0 intact, 1 damage found, 2 not an output folder, 3 in use")
    verify.add_argument("output_dir", help="a pipeline's output_dir")
    gc = sub.add_parser("gc", help="remove the outputs no kept run references (the newest run records, the "
                        "registry's versions) and say how many files and bytes")
    gc.add_argument("output_dir", help="a pipeline's output_dir")
    gc.add_argument("--dry-run", action="store_true", help="say what would be removed; remove nothing")
    gc.add_argument("--keep-runs", type=int, default=3, metavar="N", help="keep what the newest N run records "
                    "(OUTPUT_DIR/runs/*.json) reference (default 3)")
    gc.add_argument("--registry", metavar="PATH", help="the draft registry whose versions are kept "
                    "(default OUTPUT_DIR/registry)")
    add_drafts_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "run":
        stop_on_signals()  # from here on, a signal is a polite stop (checks, imports and Prefect's start included)
    if args.command == "gc":
        from tasks.gc import gc_command

        return gc_command(args.output_dir, dry_run=args.dry_run, keep_runs=args.keep_runs, registry=args.registry)
    if args.command == "verify":
        from tasks.scrub import verify_command

        return verify_command(args.output_dir)
    if args.command == "prune-shards":
        from tasks.extract.shards import prune as prune_shards

        files, freed = prune_shards(args.folder, args.keep)
        print(f"removed {files} shard files, {freed / 1e9:.2f} GB freed")
        return 0
    if args.command == "drafts":
        return drafts(args)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = load_config(args.config, parse_overrides(args.overrides))
        if args.command == "config":  # as written: demo:// and relative paths stay for the worker to resolve
            print(config.model_dump_json() if args.json
                  else yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False).rstrip())
            return 0
        output = Path(config.output_dir).resolve()
        if args.command == "run":  # a busy folder is refused before the slow start (checks, Prefect's import)
            refuse_if_busy(output, "eagle3-pipeline")
        config = config.model_copy(update={"output_dir": str(output)})  # results name absolute paths
        resolved = resolve_config(config, weights=args.command != "plan")  # a plan reads no weights
        if args.command == "plan":
            return print_plan(resolved, args.gpu_tflops, args.disk_gb_per_s, args.json, args.keep)
        check_before_run(resolved)
    except (PermanentError, FolderLockedError) as e:
        return refusal_exit(e)

    output.mkdir(parents=True, exist_ok=True)
    prefect_home = use_private_prefect_home(output)
    set_aside_damaged_database(prefect_home)
    start_run_server(prefect_home)
    if args.refresh:
        os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"
    from flows.pipeline import eagle3_pipeline  # while the server starts; after PREFECT_* are set: read at import

    try:
        wait_for_run_server(prefect_home)
    except RuntimeError as e:  # a busy machine or a port taken meanwhile: running again may work
        print(f"error: {e}", file=sys.stderr)
        return 1

    with run_log(output) as log_file:
        return run_flow(eagle3_pipeline, config, resolved, output, prefect_home, log_file)


def run_flow(pipeline, config, resolved, output: Path, prefect_home: Path, log_file: Path) -> int:
    """The flow in this process, one run per output folder at a time; a summary, or one `error:` line."""
    print(f"eagle3-pipeline: running '{config.name}' -> {output} (Prefect home: {prefect_home}; log: {log_file})")
    t0 = time.monotonic()
    try:
        with folder_lock(output, "eagle3-pipeline"):  # one run per output folder (and its Prefect database)
            run_began()
            state = pipeline(config, return_state=True)
    except (PermanentError, FolderLockedError) as e:  # another run holds the folder, or its lock file is read-only
        return refusal_exit(e)
    except Stopped as stop:  # the stage has unwound: the rest of the run ends, then this process
        end_stopped_run(stop)
    stages = stage_runs(state.state_details.flow_run_id)
    if not state.is_completed():
        return report_failure(state, stages, log_file)
    from prefect.exceptions import MissingResult

    summary = {"verifier": resolved.verifier.path, "output_dir": str(output)}
    try:
        results = state.result()
    except MissingResult:  # seen once in ~45 runs, after Prefect's database was locked for a minute: the
        # run completed, every stage's outputs are on disk, but its final state came back without its data
        print("eagle3-pipeline: every stage completed, but Prefect returned the run's final state without its "
              "results; the same command again prints them (every stage a cache hit)", file=sys.stderr)
        results = {}
    for key, value in results.items():
        stage = stages.get(STAGE_OF_RESULT[key])
        summary[key] = {"from_cache": stage is not None and stage.state.name == "Cached", **value.__dict__}
    print(json.dumps(summary, indent=1, default=str))
    print(f"eagle3-pipeline: done in {time.monotonic() - t0:.0f} s; outputs under {output}")
    for line in closing_lines(results):
        print(f"eagle3-pipeline: {line}")
    return 0


def closing_lines(results: dict) -> list[str]:
    """What a user does next: why nothing was trained, or how to serve the draft (the registry's version)."""
    drift, promoted, validated = (results.get(k) for k in ("drift", "promoted", "validated"))
    if drift is not None and not drift.retrain:
        return [f"no retraining: {drift.reason}"]
    if promoted is not None:
        return [f"draft version {promoted.version} is current in {promoted.registry}; serve it with:",
                promoted.serve_command]
    return ["serve the draft with:", validated.serve_command] if validated and validated.serve_command else []


def print_plan(config, gpu_tflops: float | None, disk_gb_per_s: float | None, as_json: bool, keep: bool) -> int:
    """The checks a plan can make without weights (data, output folder), then the plan."""
    print(f"eagle3-pipeline plan: sizing '{config.name}' for {config.verifier.path} (tokenizing "
          f"{', '.join(map(source_name, config.data.sources))}; nothing loads a model)", file=sys.stderr, flush=True)
    from tasks.plan import H100_BF16_TFLOPS, MEASURED_DISK_BYTES_PER_S, size_run

    check_data(config)
    if keep:
        check_writable(Path(config.output_dir), "output_dir")
    sizing = size_run(config, gpu_tflops or H100_BF16_TFLOPS, keep,
                      disk_gb_per_s * 1e9 if disk_gb_per_s else MEASURED_DISK_BYTES_PER_S)
    print(json.dumps(sizing.summary(), indent=1) if as_json else sizing.describe())
    return 1 if sizing.problems else 0


def add_drafts_parser(sub) -> None:
    drafts_parser = sub.add_parser("drafts", help="the draft registry: list its versions, promote one, roll back")
    actions = drafts_parser.add_subparsers(dest="action", required=True)
    listing = actions.add_parser("list", help="every version: created, τ measured by vLLM, simulated acceptance, "
                                 "validation, parent; the current one marked *")
    promote = actions.add_parser("promote", help="make version N current (it must have passed validation)")
    promote.add_argument("version", type=int, metavar="N")
    rollback = actions.add_parser("rollback", help="make current again the version that was current before the "
                                  "last promotion")
    for action, done in ((promote, "promoted by hand"), (rollback, "rolled back by hand")):
        action.add_argument("--reason", default=done, help=f"why, for the registry's history (default: {done!r})")
    for action in (listing, promote, rollback):
        action.add_argument("config", nargs="?", help="a YAML config: its registry, <registry.path>/<name>")
        action.add_argument("--registry", metavar="DIR", help="the registry's folder, <registry.path>/<name> "
                            "(instead of a config)")


@exits_on_refusal
def drafts(args) -> int:
    """`drafts list | promote N | rollback`: 0 done; 2 refused, why in one `error:` line; 3 the registry in use."""
    from tasks.registry.listing import table
    from tasks.registry.picture import draw_acceptance
    from tasks.registry.promotion import promote, rollback

    if (args.config is None) == (args.registry is None):
        raise ConfigError("drafts: name the registry, by its folder (--registry DIR) or by a config (CONFIG.yaml)")
    registry = Path(args.registry) if args.registry else load_config(args.config).registry_path
    if args.action == "list":
        print(table(registry))
        return 0
    if args.action == "promote":
        version, done = promote(registry, args.version, args.reason), "promoted"
    else:
        version, done = rollback(registry, args.reason), "rolled back to"
    print(f"{done} version {version.number}: {registry / 'current'} -> {version.path}")
    print(f"serve it with: {version.serve_command()}")
    print(f"acceptance across versions: {draw_acceptance(registry)}")
    return 0


# the flow's result keys -> the task that produced each
STAGE_OF_RESULT = {"prepared": "prepare", "extracted": "extract", "vocab": "vocab", "drift": "drift-check",
                   "trained": "train", "validated": "validate", "promoted": "promote"}


def report_failure(state, stages: dict, log_file: Path) -> int:
    """One `error:` line naming the stage and the exception, and where the whole story is; 2 when
    retrying cannot help, else 1."""
    exc = state.result(raise_on_failure=False)
    failed = [(name, run) for name, run in stages.items() if run.state.is_failed()]
    where = f"{failed[0][0]} failed" if failed else "the run failed"
    problem = describe(exc) if isinstance(exc, BaseException) else state.message
    if isinstance(exc, BaseException) and is_deterministic(exc):
        print(f"error: {where} (not retried: the same inputs would fail the same way): {problem}", file=sys.stderr)
        print(f"the full log, tracebacks included: {log_file}", file=sys.stderr)
        return 2
    attempts = f" after {failed[0][1].run_count} attempts" if failed else ""
    print(f"error: {where}{attempts}: {problem}", file=sys.stderr)
    print(f"the full log, tracebacks included: {log_file}", file=sys.stderr)
    return 1


def recorded_task_runs(flow_run_id, timeout_s: float = 60) -> list:
    """A flow run's task runs as the Prefect server recorded them, in the order they ran. Task run
    states reach the server as events, which it may still be processing when the flow returns (on
    a loaded machine the last stages had no state yet): this waits until every run has a final
    state and two reads agree, or `timeout_s` passed."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.client.schemas.sorting import TaskRunSort
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all()
    deadline, previous = time.monotonic() + timeout_s, None
    while True:
        with get_client(sync_client=True) as client:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                         sort=TaskRunSort.EXPECTED_START_TIME_ASC)
        seen = [(r.id, r.state and r.state.type, r.run_count) for r in runs]
        settled = all(r.state is not None and r.state.is_final() for r in runs) and seen == previous
        if settled or time.monotonic() > deadline:
            return runs
        previous = seen
        time.sleep(1)


def stage_runs(flow_run_id) -> dict:
    """{stage name: its last task run} of a flow run, in the order they ran."""
    return {r.name.rsplit("-", 1)[0]: r for r in recorded_task_runs(flow_run_id)}


if __name__ == "__main__":
    sys.exit(main())
