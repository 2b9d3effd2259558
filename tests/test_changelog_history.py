"""The changelog checker itself (testkit/changelog_history.py): a valid compacted history passes, and
each rule rejects a hand-made history that breaks it."""

from __future__ import annotations

from testkit.changelog_history import check_changelog


class History:
    """Builds events with increasing timestamps."""

    def __init__(self):
        self.t = 0.0
        self.events: list[dict] = []
        self.n = 0

    def _event(self, **fields):
        self.t += 1
        self.events.append({"t": self.t, **fields})

    def append(self, client, status, records, first=None, inc=None, end=True):
        """``records``: ``[(id, key, value)]``, value ``None`` = tombstone."""
        self.n += 1
        op = f"{client}/{self.n}"
        ids, keys, values = (list(column) for column in zip(*records))
        fields = {"payloads": ids, "keys": keys, "values": values}
        if inc is not None:
            fields["increments"] = {"c": inc}
        self._event(phase="invoke", op=op, kind="append", client=client, **fields)
        if end:
            result = {} if first is None else {"first_offset": first, "last_offset": first + len(ids) - 1}
            self._event(phase="end", op=op, status=status, client=client, **result)
        return op

    def begin(self, position=0):
        self._event(phase="begin", client="r", position=position)

    def seen(self, offset, record_id, key, value):
        self._event(phase="seen", client="r", offset=offset, id=record_id, key=key, value=value)

    def restart(self, at, start):
        self._event(phase="restart", client="r", at=at, start=start)


def final(records, start=0, c=None):
    return {"records": [list(r) for r in records], "start_offset": start,
            "attributes": {} if c is None else {"c": c}}


def compacted_history() -> History:
    """a: a1 then a2 (a1 compacted away); b: b1 then a tombstone that expired; c: c1 kept; a
    reader that saw everything up to c1, some of it before compaction."""
    h = History()
    h.begin()
    h.append("w0", "ok", [("a1", "a", "a1"), ("b1", "b", "b1")], 0, inc=1)
    h.seen(0, "a1", "a", "a1")
    h.seen(1, "b1", "b", "b1")
    h.append("w1", "ok", [("a2", "a", "a2")], 2, inc=2)
    h.append("w0", "ok", [("b2", "b", None)], 3, inc=4)
    h.append("w1", "failed", [("x", "a", "x")], inc=8)
    h.append("w1", "unknown", [("c1", "c", "c1")], inc=16)
    h.seen(2, "a2", "a", "a2")
    h.seen(4, "c1", "c", "c1")
    return h


def test_a_valid_compacted_history_passes():
    h = compacted_history()
    result = check_changelog(h.events, final([(2, "a2", "a", "a2"), (4, "c1", "c", "c1")], c=1 + 2 + 4 + 16))
    assert result.violations == []
    assert (result.ok, result.failed, result.unknown) == (3, 1, 1)
    assert result.tombstones_expired == 1 and result.reader_seen == 4 and result.records_written == 5


def test_rejects_a_deleted_key_that_came_back():
    h = compacted_history()
    # b's tombstone expired while b1 (superseded, once kept anyway) survived: b is back
    result = check_changelog(h.events, final([(1, "b1", "b", "b1"), (2, "a2", "a", "a2"), (4, "c1", "c", "c1")],
                                             c=23))
    assert any("deleted key came back" in v and "'b2'" in v for v in result.violations), result.violations


def test_an_older_tombstone_that_outlives_the_newest_one_is_a_deleted_key():
    """The cleaner keeps a tombstone whose batch it cannot shrink, and the key's newer tombstone
    expires: the key still reads as deleted. A value written between them is no matter either."""
    h = History()
    h.begin()
    h.append("w0", "ok", [("b1", "b", "b1")], 0)
    h.append("w0", "ok", [("b2", "b", None)], 1)
    h.append("w0", "ok", [("b3", "b", "b3"), ("b4", "b", None)], 2)
    for offset, record_id, value in [(0, "b1", "b1"), (1, "b2", None), (2, "b3", "b3"), (3, "b4", None)]:
        h.seen(offset, record_id, "b", value)
    result = check_changelog(h.events, final([(1, "b2", "b", None)]))
    assert result.violations == [] and result.tombstones_expired == 1
    # the surviving record is a value: the key came back
    result = check_changelog(h.events, final([(2, "b3", "b", "b3")]))
    assert any("deleted key came back" in v and "'b4'" in v for v in result.violations), result.violations


def test_rejects_a_lost_latest_value():
    h = compacted_history()
    result = check_changelog(h.events, final([(4, "c1", "c", "c1")], c=23))
    assert any("key 'a'" in v and "'a2' at 2" in v for v in result.violations), result.violations
    # below the start offset (retention), the same absence is fine
    assert check_changelog(h.events, final([(4, "c1", "c", "c1")], start=4, c=23)).violations == []


def test_an_unknown_append_that_may_have_come_later_leaves_the_key_unjudged():
    h = History()
    h.append("w0", "ok", [("a1", "a", "a1")], 0)
    h.append("w1", "unknown", [("a2", "a", None)], end=False)  # killed: maybe a tombstone, since expired
    result = check_changelog(h.events, final([]))
    assert result.violations == [] and result.unjudged_keys == 1
    h = History()
    h.append("w1", "unknown", [("a2", "a", None)])  # ended before a1 began: cannot supersede it
    h.append("w0", "ok", [("a1", "a", "a1")], 1)
    assert any("its latest value 'a1'" in v for v in check_changelog(h.events, final([])).violations)


def test_rejects_a_reader_that_skipped_a_surviving_record():
    h = compacted_history()
    h.events = [e for e in h.events if not (e["phase"] == "seen" and e["offset"] == 2)]
    result = check_changelog(h.events, final([(2, "a2", "a", "a2"), (4, "c1", "c", "c1")], c=23))
    assert any("never saw 'a2' at offset 2" in v for v in result.violations), result.violations


def test_rejects_a_reader_that_saw_a_record_twice_out_of_order_or_wrong():
    for bad, message in (((1, "b1", "b", "b1"), "reader: saw offset 1 after 4"),  # back
                         ((4, "c1", "c", "c1"), "reader: saw offset 4 after 4"),  # twice
                         ((5, "a1", "a", "a1"), "'a1': seen by the reader at offset 5, but acknowledged")):  # again
        h = compacted_history()
        h.seen(*bad)
        violations = check_changelog(h.events, final([(2, "a2", "a", "a2"), (4, "c1", "c", "c1")], c=23)).violations
        assert any(message in v for v in violations), (bad, violations)
    h = compacted_history()
    h.seen(5, "a1", "a", "changed")
    violations = check_changelog(h.events, final([(2, "a2", "a", "a2"), (4, "c1", "c", "c1")], c=23)).violations
    assert any("reader at 5" in v and "appended as" in v for v in violations)


def test_rejects_a_truncation_restart_that_does_not_move_forward():
    h = compacted_history()
    h.restart(at=5, start=3)
    violations = check_changelog(h.events, final([(2, "a2", "a", "a2"), (4, "c1", "c", "c1")], c=23)).violations
    assert any("RecordTruncatedError at 5" in v for v in violations)


def test_rejects_a_reused_offset():
    h = compacted_history()
    h.append("w0", "ok", [("d1", "d", "d1")], 4)  # acknowledged at 4, where c1 is stored and was seen
    violations = check_changelog(h.events, final([(2, "a2", "a", "a2"), (4, "c1", "c", "c1")], c=23)).violations
    assert any("offset 4 reused" in v for v in violations), violations
    h = compacted_history()
    violations = check_changelog(h.events, final([(2, "a2", "a", "a2"), (2, "c1", "c", "c1")], c=23)).violations
    assert any("not strictly increasing" in v for v in violations) and any("reused" in v for v in violations)


def test_rejects_a_record_that_moved_or_changed():
    h = compacted_history()
    violations = check_changelog(h.events, final([(3, "a2", "a", "a2"), (4, "c1", "c", "c1")], c=23)).violations
    assert any("'a2': stored at offset 3" in v for v in violations), violations
    violations = check_changelog(h.events, final([(2, "a2", "a", "other"), (4, "c1", "c", "c1")], c=23)).violations
    assert any("final log at 2" in v for v in violations)


def test_rejects_a_failed_append_that_is_stored_and_one_stored_twice():
    h = compacted_history()
    violations = check_changelog(h.events, final([(2, "a2", "a", "a2"), (4, "c1", "c", "c1"), (5, "x", "a", "x")],
                                                 c=23)).violations
    assert any("'x': its append failed" in v for v in violations)
    violations = check_changelog(h.events, final([(2, "a2", "a", "a2"), (4, "c1", "c", "c1"), (6, "c1", "c", "c1")],
                                                 c=23)).violations
    assert any("stored twice" in v for v in violations)


def test_rejects_a_counter_no_applied_subset_gives():
    h = compacted_history()
    records = [(2, "a2", "a", "a2"), (4, "c1", "c", "c1")]
    # c1's append is unknown but seen: its 16 must be counted; the failed 8 never
    for wrong in (1 + 2 + 4, 1 + 2 + 4 + 16 + 8, 1 + 4 + 16):
        assert any("counter c" in v for v in check_changelog(h.events, final(records, c=wrong)).violations), wrong


def test_a_batch_seen_in_part_places_its_other_records():
    h = History()
    h.append("w0", "unknown", [("a1", "a", "a1"), ("b1", "b", "b1")])
    h.append("w0", "ok", [("a2", "a", "a2")], 2)
    # a1 survives at 0, so b1 was at 1: b's latest value is gone
    violations = check_changelog(h.events, final([(0, "a1", "a", "a1"), (2, "a2", "a", "a2")])).violations
    assert any("key 'b'" in v and "'b1' at 1" in v for v in violations), violations


def test_client_reported_violations_and_notes_are_violations():
    h = compacted_history()
    h._event(phase="violation", client="r", message="waited 60 s for records that exist")
    op = h.append("cc", "failed", [("z", "z", "z")])
    h.events[-1]["note"] = "InvalidInputError from a lost race"
    violations = check_changelog(h.events, final([(2, "a2", "a", "a2"), (4, "c1", "c", "c1")], c=23)).violations
    assert "r: waited 60 s for records that exist" in violations
    assert f"{op}: InvalidInputError from a lost race" in violations
