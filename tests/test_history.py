"""The history checker itself: hand-made histories that each rule must reject (and valid ones it
must accept), and the recorder's file format (a torn last line from a killed process)."""

from __future__ import annotations

import os

import pytest

from attrindex.errors import BadOffsetError, OutcomeUnknownError
from testkit.history import Recorder, check, load_history, subset_sums


class Clock:
    """Builds events with increasing timestamps."""

    def __init__(self):
        self.t = 0.0
        self.events: list[dict] = []
        self.n = 0

    def op(self, client, kind, status, result=None, *, end=True, **fields):
        self.n += 1
        op_id = f"{client}/{self.n}"
        self.t += 1
        self.events.append({"phase": "invoke", "op": op_id, "kind": kind, "client": client, "t": self.t, **fields})
        if end:
            self.t += 1
            self.events.append({"phase": "end", "op": op_id, "status": status, "client": client, "t": self.t,
                                **(result or {})})
        return op_id


def append(h, client, status, payloads, first=None, inc=None, cas=None, end=True):
    fields = {"payloads": payloads}
    if inc is not None:
        fields["increments"] = {"c": inc}
    if cas is not None:
        fields["cas"] = ["k", *cas]
    result = {} if first is None else {"first_offset": first, "last_offset": first + len(payloads) - 1}
    return h.op(client, "append", status, result, end=end, **fields)


def state(records, **attributes):
    return {"records": [[o, p] for o, p in records], "attributes": attributes}


def violations(h, final):
    return check(h.events, final).violations


def test_a_valid_history_passes():
    h = Clock()
    append(h, "a", "ok", ["a1"], 0, inc=2)
    append(h, "b", "ok", ["b1", "b2"], 1, inc=3)
    append(h, "a", "unknown", ["a2"], inc=5)  # applied
    append(h, "b", "unknown", ["b3"], inc=7)  # not applied
    append(h, "a", "failed", ["a3"], inc=11)
    h.op("r", "read", "ok", {"value": 5}, counter="c", fresh=True)
    append(h, "a", "ok", ["a4"], 4, cas=[None, 10])
    append(h, "b", "ok", ["b4"], 5, cas=[10, 20])
    append(h, "a", "failed", ["a5"], cas=[10, 30])
    append(h, "a", "unknown", ["a6"], cas=[20, 40], end=False)  # killed mid-call, applied
    final = state([(0, "a1"), (1, "b1"), (2, "b2"), (3, "a2"), (4, "a4"), (5, "b4"), (6, "a6")], c=10, k=40)
    result = check(h.events, final)
    assert result.violations == [] and result.ok == 4 and result.unknown_applied == 2


def test_rejects_an_acknowledged_append_missing():
    h = Clock()
    append(h, "a", "ok", ["a1"], 0)
    append(h, "a", "ok", ["a2"], 1)
    result = check(h.events, state([(0, "a1")]))
    assert result.lost == 1 and any("acknowledged but missing" in v for v in result.violations)


def test_rejects_a_duplicate_of_an_ok_or_unknown_append():
    for status in ("ok", "unknown"):
        h = Clock()
        append(h, "a", status, ["a1"], 0 if status == "ok" else None)
        result = check(h.events, state([(0, "a1"), (1, "a1")]))
        assert result.duplicates == 1, status


def test_rejects_a_failed_append_that_is_stored():
    h = Clock()
    append(h, "a", "failed", ["a1"])
    assert any("failed" in v for v in violations(h, state([(0, "a1")])))


def test_rejects_part_of_an_append():
    h = Clock()
    append(h, "a", "unknown", ["a1", "a2"])
    assert any("only part" in v for v in violations(h, state([(0, "a1")])))


def test_rejects_an_offset_used_twice():
    h = Clock()
    append(h, "a", "ok", ["a1"], 0)
    append(h, "b", "ok", ["b1"], 0)
    found = violations(h, state([(0, "a1"), (0, "b1")]))
    assert any("acknowledged to both" in v for v in found) and any("holds 2 records" in v for v in found)


def test_rejects_an_acknowledged_offset_that_is_not_where_the_records_are():
    h = Clock()
    append(h, "a", "ok", ["a1"], 0)
    assert any("acknowledged at offset 0" in v for v in violations(h, state([(1, "a1")])))


def test_rejects_decreasing_offsets_of_one_client():
    h = Clock()
    append(h, "a", "ok", ["a1"], 1)
    append(h, "a", "ok", ["a2"], 0)
    assert any("not increasing" in v for v in violations(h, state([(0, "a2"), (1, "a1")])))


def test_rejects_a_counter_off_by_an_unknown_subset():
    h = Clock()
    append(h, "a", "ok", ["a1"], 0, inc=2)
    h.op("a", "append", "unknown", None, increments={"c": 3})  # no records: only the sum tells
    h.op("a", "append", "unknown", None, increments={"c": 5})
    final = state([(0, "a1")], c=2 + 3 + 5)
    assert violations(h, final) == []
    for wrong in (0, 4, 2 + 3 + 5 + 2):  # below the acknowledged sum, not a subset sum, counted twice
        assert any("counter c" in v for v in violations(h, state([(0, "a1")], c=wrong))), wrong


def test_rejects_a_counter_that_disagrees_with_the_appends_stored():
    h = Clock()
    append(h, "a", "ok", ["a1"], 0, inc=2)
    append(h, "a", "unknown", ["a2"], inc=3)
    # 5 would be a valid subset sum, but a2's records are absent: its increment must be too
    assert any("appends stored add up to 2" in v for v in violations(h, state([(0, "a1")], c=5)))


def test_rejects_compare_and_set_updates_that_form_no_chain():
    h = Clock()
    append(h, "a", "ok", ["a1"], 0, cas=[None, 1])
    append(h, "b", "ok", ["b1"], 1, cas=[None, 2])  # both from absent: a lost update
    assert any("compare-and-set" in v for v in violations(h, state([(0, "a1"), (1, "b1")], k=2)))
    h = Clock()
    append(h, "a", "ok", ["a1"], 0, cas=[None, 1])
    append(h, "b", "ok", ["b1"], 1, cas=[1, 2])
    assert any("compare-and-set" in v for v in violations(h, state([(0, "a1"), (1, "b1")], k=1)))  # rolled back


def test_accepts_a_chain_through_unknown_updates():
    h = Clock()
    append(h, "a", "ok", ["a1"], 0, cas=[None, 1])
    append(h, "b", "unknown", ["b1"], cas=[1, 2])
    append(h, "a", "ok", ["a2"], 2, cas=[2, 3])
    assert violations(h, state([(0, "a1"), (1, "b1"), (2, "a2")], k=3)) == []


def test_rejects_counter_reads_no_prefix_gives():
    h = Clock()
    append(h, "a", "ok", ["a1"], 0, inc=2)
    append(h, "a", "ok", ["a2"], 1, inc=3)
    h.op("r", "read", "ok", {"value": 4}, counter="c")  # neither 0, 2, 3 nor 5
    assert any("no prefix" in v for v in violations(h, state([(0, "a1"), (1, "a2")], c=5)))


def test_rejects_a_fresh_read_missing_an_acknowledged_write():
    h = Clock()
    append(h, "a", "ok", ["a1"], 0, inc=2)
    h.op("r", "read", "ok", {"value": 0}, counter="c", fresh=True)
    assert any("after 2 was acknowledged" in v for v in violations(h, state([(0, "a1")], c=2)))


def test_rejects_a_counter_going_back_for_one_reader():
    h = Clock()
    append(h, "a", "ok", ["a1"], 0, inc=2)
    h.op("r", "read", "ok", {"value": 2}, counter="c")
    h.op("r", "read", "ok", {"value": 0}, counter="c")
    assert any("went back" in v for v in violations(h, state([(0, "a1")], c=2)))


def test_rejects_a_records_read_the_final_log_contradicts():
    h = Clock()
    append(h, "a", "ok", ["a1"], 0)
    h.op("r", "read", "ok", {"records": [[0, "zz"]]})
    assert any("read 'zz'" in v for v in violations(h, state([(0, "a1")])))


def test_rejects_non_project_exceptions():
    h = Clock()
    h.op("a", "append", "unknown", {"note": "non-project exception OSError: boom"}, payloads=["a1"])
    assert any("OSError" in v for v in violations(h, state([])))


def test_events_may_be_resent_but_stored_once():
    h = Clock()
    h.op("w", "events", "unknown", None, payloads=["w:1", "w:2"])
    h.op("w", "events", "ok", None, payloads=["w:1", "w:2", "w:3"])  # a restarted life resends
    assert violations(h, state([(0, "w:1"), (1, "w:2"), (2, "w:3")])) == []
    assert check(h.events, state([(0, "w:1"), (1, "w:2"), (2, "w:3"), (3, "w:2")])).duplicates == 1
    assert check(h.events, state([(0, "w:1"), (1, "w:2")])).lost == 1


def test_recorder_classifies_outcomes_and_survives_a_torn_last_line(tmp_path):
    recorder = Recorder(str(tmp_path / "a.jsonl"), "a")
    with recorder.operation("append", payloads=["x"]) as out:
        out.update(first_offset=0, last_offset=0)
    with recorder.operation("append", payloads=["y"]):
        raise BadOffsetError("s", 1, 2)
    with recorder.operation("append", payloads=["z"]):
        raise OutcomeUnknownError("lost")
    with recorder.operation("append", payloads=["w"]):
        raise OSError("raw")
    recorder.invoke("append", payloads=["v"])  # a kill before the end
    recorder.close()
    with open(tmp_path / "a.jsonl", "a") as torn:
        torn.write('{"phase": "inv')
    events = load_history(str(tmp_path))
    ends = [e["status"] for e in events if e["phase"] == "end"]
    assert ends == ["ok", "failed", "unknown", "unknown"]
    result = check(events, state([(0, "x"), (1, "z")]))
    assert result.unknown_applied == 1 and len(result.violations) == 1 and "OSError" in result.violations[0]
    os.remove(tmp_path / "a.jsonl")


def test_subset_sums():
    assert subset_sums([1, 2, 5]) == {0, 1, 2, 3, 5, 6, 7, 8}
    assert subset_sums(list(range(1, 40)), limit=100) is None


@pytest.mark.parametrize("final", [state([(0, "a1")], c=3), state([(0, "a1")], c=1)])
def test_a_single_ok_increment_must_be_exact(final):
    h = Clock()
    append(h, "a", "ok", ["a1"], 0, inc=2)
    assert violations(h, final)
