"""Serve the draft that bench/acceptance.py trained on a GPU in vLLM here, and record vLLM's measured
acceptance next to the simulated one.

    python bench/validate_returned_draft.py RETURNED_DIR [--prompts 80 --max-new-tokens 256]

RETURNED_DIR holds `draft_config.json`, `draft.safetensors.part*` and, when bench/recipe.py scored the
draft on MT-Bench there, `acceptance.json`. The draft
is reassembled (its verifier path pointed at the local SmolLM2 demo asset: the same model), checked
statically, and served greedily on MT-Bench first turns with k=3.
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
    draft.mkdir(parents=True, exist_ok=True)
    parts = sorted(returned.glob("draft.safetensors.part*"), key=lambda p: int(p.name.rsplit("part", 1)[1]))
    (draft / "model.safetensors").write_bytes(b"".join(p.read_bytes() for p in parts))
    config = json.loads((returned / "draft_config.json").read_text())
    config["speculators_config"]["verifier"]["name_or_path"] = str(verifier)
    (draft / "config.json").write_text(json.dumps(config, indent=1))
    return draft


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("returned")
    p.add_argument("--prompts", type=int, default=80)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--record", metavar="FIGURE",
                   help="replace FIGURE (e.g. preset_vllm_acceptance_length) in docs/benchmarks.json (bench/record.py)")
    p.add_argument("--trained", default="", help="with --record: how and where the draft was trained (the command)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    returned = Path(a.returned)
    verifier = ensure_asset("smollm2-135m-instruct")
    draft = reassemble(returned, returned.parent / "returned-draft", verifier)
    scored = returned / "acceptance.json"  # bench/recipe.py's MT-Bench score of the draft, when it ran
    simulated = json.loads(scored.read_text())["ours"]["simulated_acceptance_length"] if scored.exists() else None
    settings = ValidationSettings(prompts=str(ensure_asset("mt-bench")), max_prompts=a.prompts,
                                  max_new_tokens=a.max_new_tokens)
    result = validate(str(draft), str(verifier), json.loads((draft / "config.json").read_text())[
        "eagle_aux_hidden_state_layer_ids"], settings, returned.parent / "returned-validation",
        simulated_acceptance_length=simulated)
    print(json.dumps({"vllm_mean_acceptance_length": result.mean_acceptance_length,
                      "vllm_per_position_acceptance": result.per_position_acceptance,
                      "simulated_acceptance_length_mtbench": simulated,
                      "identical_outputs": result.identical_outputs, "report": result.report_markdown}))
    if a.record:
        record({a.record: {"value": round(result.mean_acceptance_length, 3),
                           "unit": "mean acceptance length (tokens per verifier step), k=3",
                           "per_position_acceptance": [round(x, 3) for x in result.per_position_acceptance],
                           "identical_greedy_outputs": f"{result.identical_outputs}",
                           "prompts": f"{a.prompts} MT-Bench first turns, {a.max_new_tokens} new tokens, greedy, k=3",
                           "mtbench_chained": simulated, "trained": a.trained}})


if __name__ == "__main__":
    main()
