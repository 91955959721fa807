"""The append-only journal of finished work (regeneration parts, shard journals)."""

from __future__ import annotations


def test_journal_skips_a_torn_last_line_and_discards_a_damaged_file(tmp_path):
    from tasks.common.journal import Journal

    parts = Journal(tmp_path, "parts", key="id")
    parts.append({"id": "c0", "messages": []}, {"id": "c1", "reason": "empty_generation"})
    (mine,) = (tmp_path / "parts").glob("*.jsonl")
    mine.write_bytes(mine.read_bytes() + b'{"id": "c2", "mess')  # a kill cut the next chunk's write
    assert sorted(parts.entries()) == ["c0", "c1"] and mine.exists()
    for damage in (b"\x9c\xff garbage\n", b"[1]\n", b'{"messages": []}\n'):  # bytes, not an object, no id
        other = tmp_path / "parts" / "other-1.jsonl"
        other.write_bytes(damage + b'{"id": "c3", "messages": []}\n')
        assert sorted(parts.entries()) == ["c0", "c1"] and not other.exists()  # discarded: c3 is redone
