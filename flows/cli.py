"""Command line: `eagle3-pipeline run CONFIG.yaml [--set section.key=value ...]`.

Runs the flow in-process on Prefect's ephemeral server (no server to start). Unless PREFECT_HOME
is set, Prefect's database and result store live in `<output_dir>/.prefect`, so runs of one
output folder share a cache and nothing leaks into ~/.prefect.
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

from flows.prefect_env import use_private_prefect_home
from tasks.config import ConfigError, load_config


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
        node[leaf] = yaml.safe_load(value)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eagle3-pipeline", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the pipeline flow on a config file")
    run.add_argument("config", help="YAML config (see deployments/)")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a setting, e.g. --set train.epochs=2 (repeatable)")
    run.add_argument("--refresh", action="store_true",
                     help="ignore Prefect's task cache (stages still reuse valid outputs on disk)")
    prune = sub.add_parser("prune-shards", help="delete hidden-state shards no extraction manifest lists")
    prune.add_argument("folder", help="an output's hidden_states/ folder")
    prune.add_argument("--keep", metavar="MANIFEST", help="keep only this manifest's shards (and manifest)")
    args = parser.parse_args(argv)
    if args.command == "prune-shards":
        from tasks.shards import prune as prune_shards

        files, freed = prune_shards(args.folder, args.keep)
        print(f"removed {files} shard files, {freed / 1e9:.2f} GB freed")
        return 0

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        config = load_config(args.config, parse_overrides(args.overrides))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    output = Path(config.output_dir).resolve()
    output.mkdir(parents=True, exist_ok=True)
    prefect_home = use_private_prefect_home(output)
    if args.refresh:
        os.environ["PREFECT_TASKS_REFRESH_CACHE"] = "true"
    from flows.pipeline import eagle3_pipeline  # after PREFECT_HOME is set: Prefect reads it at import

    print(f"eagle3-pipeline: running '{config.name}' -> {output} (Prefect home: {prefect_home})")
    t0 = time.monotonic()
    result = eagle3_pipeline(config)
    summary = {k: (v.__dict__ if hasattr(v, "__dict__") else v) for k, v in result.items()}
    print(json.dumps(summary, indent=1, default=str))
    print(f"eagle3-pipeline: done in {time.monotonic() - t0:.0f} s; outputs under {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
