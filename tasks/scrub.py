"""The scrub, `eagle3-pipeline verify OUTPUT_DIR`: every file a run trusts, read again in full.

A cached run checks only what is quick (a vocabulary's checksums, a quarantine's marks, a draft's
seal and sizes); the scrub reads every byte:
- hidden-state shards, against the checksums of the manifests that list them (tasks/extract/shards.py);
  one that fails is moved aside as `<shard>.damaged` and the next run extracts it again;
- training checkpoints and the exported draft, against their seals (tasks/common/sealed.py), and a
  checkpoint's training state as a resume reads it; one that fails is moved into its training folder's
  `damaged/`, and so is a checkpoint whose best checkpoint (the one a resume would export) failed;
  the next run trains again from the newest intact checkpoint and exports the draft again;
- journals (tasks/common/journal.py): the regeneration's answers and the synthesis's prompts, whose
  records carry checksums, and the extraction's journal of shards. A record that fails is discarded by
  any reader; here its file is moved aside as `<part>.jsonl.damaged` and its intact records written
  back, so the next run redoes what the record held (an answer, a prompt; a shard is only verified again);
- vocabularies, against their checksums (the next run builds a damaged one again, as it does now);
- validation reports (validation/<fp>/report.json), read as the run summary, the registry and its gate read
  them; one that is not a report is moved aside as `report.json.damaged` and the next run validates again.

The damage is repaired by the same `eagle3-pipeline run CONFIG`: each stage's cache key sees what was
moved aside here (`training_repairs_pending`, `journal_repairs_pending`, shards.quarantined_shards),
until the stage has run again.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from tasks.common.errors import PermanentError
from tasks.common.folder_lock import folder_lock
from tasks.common.journal import Journal, record_checksum
from tasks.common.refusals import exits_on_refusal
from tasks.common.sealed import damage
from tasks.extract.shards import QUARANTINE_SUFFIX, ShardError, ShardReader, quarantined_shards, shard_journal
from tasks.prepare.answer_store import answer_journal
from tasks.prepare.synthesize import written

DRAFT_MARKER, CHECKPOINT_MARKER, VOCAB_MARKER = "CHECKSUMS.json", "COMPLETE", "report.json"
DAMAGED_FOLDER = "damaged"  # a training folder's checkpoints and drafts moved aside
ANSWER_PARTS, PROMPT_PARTS = "regenerated/answers-*/parts", "synthesized/*/parts"
OUTPUT_FOLDERS = ("hidden_states", "train", "vocab", "regenerated", "synthesized", "validation")


class NotAnOutputFolder(PermanentError, ValueError):
    """`verify` was given a path that holds no pipeline outputs."""


@exits_on_refusal
def verify_command(output_dir: str) -> int:
    """`eagle3-pipeline verify OUTPUT_DIR`: one line per problem and the command that repairs them all.
    0 all is well; 1 damage found (moved aside); 2 not an output folder; 3 a run holds the folder."""
    out = Path(output_dir).resolve()
    if not out.is_dir():
        raise NotAnOutputFolder(f"{out} is not a folder")
    if not any((out / stage).is_dir() for stage in OUTPUT_FOLDERS):
        raise NotAnOutputFolder(f"{out} holds no pipeline outputs ({', '.join(f + '/' for f in OUTPUT_FOLDERS)}): "
                                "give a config's output_dir")
    with folder_lock(out, "eagle3-pipeline verify"):  # no run moves files while they are checked
        problems = scrub(out)
    for problem in problems:
        print(problem.line())
    if not problems:
        print(f"verified {out}: every shard, checkpoint, draft, journal, vocabulary and validation report is intact")
        return 0
    print(f"{len(problems)} problem(s), each line says what was done with it. Repair: run the config that wrote "
          f"{out} again, unchanged: `eagle3-pipeline run CONFIG` (no --refresh needed: each stage redoes what is "
          "missing, the rest stays cached)")
    return 1


@dataclass(frozen=True)
class Problem:
    path: Path
    what: str  # why it cannot be trusted, and what the scrub did with it

    def line(self) -> str:
        named = self.what.startswith(str(self.path))  # a shard's check names the file itself
        return f"damaged: {self.what}" if named else f"damaged: {self.path}: {self.what}"


def scrub(output_dir: str | Path) -> list[Problem]:
    """Every problem found under `output_dir`, what failed already moved aside."""
    out = Path(output_dir)
    return [*scrub_shards(out / "hidden_states"), *scrub_training(out / "train"), *scrub_journals(out),
            *scrub_vocabularies(out / "vocab"), *scrub_validation_reports(out / "validation")]


# ---------------------------------------------------------------------------------- shards


def scrub_shards(folder: Path) -> list[Problem]:
    """Every shard a manifest lists, once, against that manifest (ShardReader.verify moves a failing one
    aside); a damaged manifest is moved aside too (the extraction writes it again)."""
    pending = quarantined_shards(folder) if folder.is_dir() else []
    problems = [Problem(folder / name, "moved aside by an earlier check and not extracted again yet")
                for name in pending]
    checked = set(pending)
    for manifest in sorted(folder.glob("manifest-*.json")):
        try:
            reader = ShardReader(manifest)
        except ShardError as e:
            aside = unused_name(manifest.with_name(manifest.name + QUARANTINE_SUFFIX))
            os.replace(manifest, aside)
            problems.append(Problem(manifest, f"{e}; moved aside as {aside.name}"))
            continue
        streamed = "stream" in reader.manifest  # its shards are deleted once trained on: only those there count
        for s, shard in enumerate(reader.manifest["shards"]):
            if shard["name"] in checked or (streamed and not reader.path(s).is_file()):
                continue
            checked.add(shard["name"])
            try:
                reader.verify([s])
            except ShardError as e:  # its message says it was moved aside and that the next run extracts it
                problems.append(Problem(reader.path(s), str(e)))
    return problems


# ---------------------------------------------------------------------------------- training


def scrub_training(train_root: Path) -> list[Problem]:
    problems: list[Problem] = []
    for folder in sorted(p for p in train_root.glob("[!.]*") if p.is_dir()):  # not a temporary folder
        problems += [Problem(p, "moved aside by an earlier check; the next run trains again and exports the draft")
                     for p in pending_asides(folder)]
        problems += scrub_checkpoints(folder)
        draft = folder / "draft"
        if draft.is_dir() and (problem := damage(draft, DRAFT_MARKER)):
            problems.append(Problem(draft, f"{problem}; {move_aside(draft)}"))
    return problems


def scrub_checkpoints(folder: Path) -> list[Problem]:
    """Each sealed checkpoint's files against its seal, and its training state read as a resume reads it;
    then the intact ones whose best checkpoint failed (a resume from them would export a damaged one)."""
    from tasks.train.checkpoints import CheckpointError, checkpoint_dirs, load_training_state

    problems, damaged, best_of = [], set(), {}
    for path in checkpoint_dirs(folder):
        problem = damage(path, CHECKPOINT_MARKER)
        if problem is None:
            try:
                best_of[path] = load_training_state(path / "training_state.pt")["best"]["step"]
            except (CheckpointError, KeyError, TypeError) as e:
                problem = str(e)
        if problem is not None:
            damaged.add(path.name)
            problems.append(Problem(path, f"{problem}; {move_aside(path)}"))
    for path, best in best_of.items():
        if f"step-{best:08d}" in damaged and path.name not in damaged:
            problems.append(Problem(path, f"its best checkpoint, step-{best:08d}, is damaged, and a resume from it "
                                          f"would export that one; {move_aside(path)}"))
    return problems


def move_aside(path: Path) -> str:
    """Move a checkpoint or draft folder into its training folder's `damaged/` (never deleted; a name
    that never looks like a checkpoint or a draft); returns what to tell the user."""
    train_folder = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    (train_folder / DAMAGED_FOLDER).mkdir(exist_ok=True)
    aside = unused_name(train_folder / DAMAGED_FOLDER / path.name)
    os.replace(path, aside)
    return f"moved to {aside}; run the same command again and training redoes it (and exports the draft again)"


def unused_name(path: Path) -> Path:
    """`path`, or where the same thing was set aside before (damaged again after a repair), `<stem>-2<suffix>`..."""
    n, candidate = 1, path
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.stem}-{n}{path.suffix}")
    return candidate


def pending_asides(train_folder: Path) -> list[Path]:
    """What the scrub moved aside from a training folder since its draft was last exported: training has
    not run again since (every training run ends by exporting the draft, after any checkpoint it redid)."""
    marker = train_folder / "draft" / DRAFT_MARKER
    exported = marker.stat().st_mtime_ns if marker.is_file() else 0
    return sorted(p for p in (train_folder / DAMAGED_FOLDER).glob("*") if p.stat().st_ctime_ns > exported)


def training_repairs_pending(train_folder: str | Path) -> str | None:
    """Why the train stage must run again though its cache holds a result (flows/stages.py): something was
    moved aside since the last export, or the draft's seal or a file's size is not what was written (the
    quick check a cached run makes; the scrub reads every byte). None when nothing says so."""
    folder = Path(train_folder)
    if aside := pending_asides(folder):
        return f"{aside[0]} was moved aside as damaged"
    draft = folder / "draft"
    if not draft.is_dir():  # result.json: a training process finished here (and exported the draft)
        return f"{draft} is missing" if (folder / "result.json").is_file() else None
    try:
        listed = json.loads((draft / DRAFT_MARKER).read_text()).get("files") or {}
    except (OSError, ValueError) as e:
        return f"its seal {draft / DRAFT_MARKER} cannot be read ({e})"
    for name, want in listed.items():
        path = draft / name
        if not path.is_file() or path.stat().st_size != want["bytes"]:
            return f"{path} is missing or not the size written"
    return None


# ---------------------------------------------------------------------------------- journals


def journals(out: Path) -> list[tuple[Journal, str]]:
    """The answer and prompt journals of the output folder, with what the next run does for a record
    it discards."""
    found = [(answer_journal(parts.parent), "the next run answers that conversation again")
             for parts in sorted(out.glob(ANSWER_PARTS))]
    found += [(written(parts.parent), "the next run writes that prompt again")
              for parts in sorted(out.glob(PROMPT_PARTS))]
    return found


def damaged_records(journal: Journal, data: bytes) -> list[int]:
    """The numbers of the lines a reader discards: not a record, or changed since written (its crc). The
    last line, cut off by a crash, is no damage: the work it would have recorded was never done."""
    lines = data.split(b"\n")[:-1]
    damaged = []
    for number, line in enumerate(lines, 1):
        try:
            entry = json.loads(line)
        except (UnicodeDecodeError, json.JSONDecodeError):
            damaged.append(number)
            continue
        if not isinstance(entry, dict) or any(not isinstance(entry.get(k), t) for k, t in journal.fields.items()):
            damaged.append(number)
            continue
        crc = entry.pop("crc", None)
        if crc is not None and crc != record_checksum(entry):
            damaged.append(number)
    return damaged


def scrub_journals(out: Path) -> list[Problem]:
    """The answer and prompt journals (with what was moved aside from them and not redone yet), and the
    extraction's journal of shards, whose damage costs only verifying a shard again."""
    problems = []
    for journal, redo in journals(out):
        problems += [Problem(p, "moved aside by an earlier check; the next run redoes its records")
                     for p in pending_journal_asides(journal.folder)]
        problems += scrub_journal(journal, redo)
    return problems + scrub_journal(shard_journal(out / "hidden_states"), "the next extraction verifies that "
                                    "shard in full")


def scrub_journal(journal: Journal, redo: str) -> list[Problem]:
    problems = []
    for part in sorted(journal.folder.glob("*.jsonl")):
        data = part.read_bytes()
        if numbers := damaged_records(journal, data):
            aside = set_records_aside(part, data, numbers)
            problems.append(Problem(part, f"{len(numbers)} record(s) unreadable or changed since written (line "
                                          f"{', '.join(map(str, numbers[:5]))}): the file moved aside as "
                                          f"{aside.name}, its other records kept; {redo}"))
    return problems


def set_records_aside(part: Path, data: bytes, numbers: list[int]) -> Path:
    """The journal file moved aside whole, and its other lines (a torn last one included) written back
    under its name: the reader then finds only intact records, and the damaged ones stay on disk."""
    lines = data.split(b"\n")
    kept = b"\n".join(line for number, line in enumerate(lines, 1) if number not in numbers)
    tmp, aside = part.with_name(f".tmp-{part.name}"), unused_name(part.with_name(part.name + QUARANTINE_SUFFIX))
    with tmp.open("wb") as f:
        f.write(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(part, aside)
    os.replace(tmp, part)
    return aside


def pending_journal_asides(parts: Path) -> list[Path]:
    """Journal files moved aside since the stage that reads them last finished: its outputs' report
    (`report.json`, written at the end of every regeneration or synthesis) is older."""
    run_outputs = parts.parent.parent.glob("*/report.json") if parts.parent.name.startswith("answers-") \
        else [parts.parent / "report.json"]
    finished = max((p.stat().st_mtime_ns for p in run_outputs), default=0)
    return sorted(p for p in parts.glob(f"*{QUARANTINE_SUFFIX}") if p.stat().st_ctime_ns > finished)


def journal_repairs_pending(output_dir: str | Path) -> str | None:
    """Why the prepare stage must run again though its cache holds a result (flows/stages.py): an answer
    or prompt journal moved aside by the scrub since regeneration or synthesis last finished."""
    out = Path(output_dir)
    for parts in [*out.glob(ANSWER_PARTS), *out.glob(PROMPT_PARTS)]:
        if aside := pending_journal_asides(parts):
            return f"{aside[0]} was moved aside as damaged"
    return None


# ---------------------------------------------------------------------------------- vocabulary


def scrub_vocabularies(root: Path) -> list[Problem]:
    """Each vocabulary against its checksums. Left where it is: the vocab stage sees the damage itself
    (tasks/vocab.py `vocab_damage`) and builds it again."""
    return [Problem(folder, f"{problem}; the next run builds it again")
            for folder in sorted(p for p in root.glob("[!.]*") if p.is_dir())  # not one being written
            if (problem := damage(folder, VOCAB_MARKER))]


# ---------------------------------------------------------------------------------- validation


def scrub_validation_reports(root: Path) -> list[Problem]:
    """Each validation's report.json, read as the run summary, the registry and its gate read it. One that is
    not a report is moved aside as `report.json.damaged`: the validate stage's cache key sees its report gone
    (flows/stages.py `_validate_key`), and the next run validates that draft again."""
    redo = "the next run validates that draft again"
    problems = [Problem(aside.with_name("report.json"), f"moved aside by an earlier check; {redo}")
                for aside in sorted(root.glob(f"[!.]*/report.json{QUARANTINE_SUFFIX}"))
                if not aside.with_name("report.json").exists()]
    for report in sorted(root.glob("[!.]*/report.json")):  # not a temporary folder
        try:
            read = json.loads(report.read_bytes())
            problem = None if isinstance(read, dict) and "static" in read else "JSON, but no report's static checks"
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            problem = f"not JSON ({e})"
        if problem:
            aside = unused_name(report.with_name(report.name + QUARANTINE_SUFFIX))
            os.replace(report, aside)
            problems.append(Problem(report, f"not a validation report: {problem}; moved aside as {aside.name}; {redo}"))
    return problems
