"""Serve the draft that bench/acceptance.py trained on a GPU in vLLM here, and record vLLM's measured
acceptance next to the simulated one.

    python bench/validate_returned_draft.py RETURNED_DIR [--prompts 80 --max-new-tokens 256] [--prompts-file JSONL]

RETURNED_DIR holds `draft_config.json`, `draft.safetensors.part*` and, when bench/recipe.py scored the
draft on MT-Bench there, `acceptance.json` (bench/recipe.py --return writes one such folder per draft,
OUT/drafts/NAME/). The draft
is reassembled (its verifier path pointed at the local SmolLM2 demo asset: the same model), checked
statically, and served greedily on MT-Bench first turns with k=3 (or the first turns of `--prompts-file`:
JSONL of `turns`, `prompt` or `text`, e.g. bench/narrow_workload.py's held-out prompts).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import record  # noqa: E402
from tasks.common.config import ValidationSettings  # noqa: E402
from tasks.common.demo_assets import ensure_asset  # noqa: E402
from tasks.validate.stage import validate  # noqa: E402


def reassemble(returned: Path, draft: Path, verifier: Path) -> Path:
    """The draft's folder again: its parts joined, and its frozen lm_head (left out by
    bench/acceptance.split_for_return) rebuilt from the verifier's head as speculators builds it."""
    from safetensors.torch import load, save_file
    from speculators.utils.loading import load_model_layers

    draft.mkdir(parents=True, exist_ok=True)
    parts = sorted(returned.glob("draft.safetensors.part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
    weights = load(b"".join(p.read_bytes() for p in parts))
    if "lm_head.weight" not in weights:
        verifier_weights = load_model_layers(["embed_tokens.weight", "lm_head.weight"], str(verifier))
        head = verifier_weights.get("lm_head.weight", verifier_weights["embed_tokens.weight"])  # tied: the embedding
        weights["lm_head.weight"] = (head[weights["t2d"].bool()] if "t2d" in weights else head).contiguous()
    save_file(weights, str(draft / "model.safetensors"))
    config = json.loads((returned / "draft_config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = str(verifier)
    (draft / "config.json").write_text(json.dumps(config, indent=1))
    return draft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("returned")
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--prompts-file", type=Path, help="JSONL of prompts to serve instead of MT-Bench's")
    p.add_argument("--work", type=Path, default=Path("/tmp/returned-drafts"),
                   help="where the draft is reassembled and served (WORK/<returned folder's name>/)")
    p.add_argument("--record", metavar="FIGURE",
                   help="replace FIGURE (e.g. preset_vllm_acceptance_length) in docs/benchmarks.json (bench/record.py)")
    p.add_argument("--trained", default="", help="with --record: how and where the draft was trained (the command)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    returned = Path(a.returned)
    verifier = ensure_asset("smollm2-135m-instruct")
    work = a.work / returned.resolve().name  # the returned folder may be read-only
    draft = reassemble(returned, work / "draft", verifier)
    scored = returned / "acceptance.json"  # bench/recipe.py's MT-Bench scores of the draft, when it ran
    scores = json.loads(scored.read_text()).get("ours", {}) if scored.exists() else {}  # {}: returned unscored
    simulated, replayed = scores.get("simulated_acceptance_length"), scores.get("replayed_acceptance_length")
    prompts = a.prompts_file or ensure_asset("mt-bench")
    settings = ValidationSettings(prompts=str(prompts), max_prompts=a.prompts,
                                  max_new_tokens=a.max_new_tokens)
    served_on = work / (f"validation-{Path(prompts).stem}" if a.prompts_file else "validation")
    result = validate(str(draft), str(verifier), json.loads((draft / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"], settings, served_on,
        simulated_acceptance_length=simulated, replayed_acceptance_length=replayed)
    print(json.dumps({"vllm_mean_acceptance_length": result.mean_acceptance_length,
                      "vllm_per_position_acceptance": result.per_position_acceptance,
                      "simulated_acceptance_length_mtbench": simulated, "replayed_acceptance_length_mtbench": replayed,
                      "identical_outputs": result.identical_outputs, "report": result.report_markdown}))
    if a.record:
        record({a.record: {"value": round(result.mean_acceptance_length, 3),
                           "unit": "mean acceptance length (tokens per verifier step), k=3",
                           "per_position_acceptance": [round(x, 3) for x in result.per_position_acceptance],
                           "identical_greedy_outputs": f"{result.identical_outputs}",
                           "prompts": f"{a.prompts} MT-Bench first turns, {a.max_new_tokens} new tokens, greedy, k=3",
                           "mtbench_chained": simulated, "mtbench_replayed": replayed, "trained": a.trained}})


if __name__ == "__main__":
    main()
