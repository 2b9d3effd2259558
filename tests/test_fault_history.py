"""Concurrent clients under injected storage faults, then the history checker over what is stored.

Segment clients (ACCUMULATE appends with records, compare-and-set appends, fresh counter reads,
records reads) and ``EventWriter`` clients run as threads and as child processes, the processes
SIGKILLed at random and restarted, all through ``FaultyStorage`` (errors before the write, lost
acknowledgements, latency, and a full disk on local disk). Then ``testkit.history.check`` proves:
acknowledged writes exactly once, unknown ones at most once, failed ones absent, offsets unique and
increasing, counters = acknowledged + a subset of unknown increments, one CAS chain, valid reads.
The Spark write protocol (no JVM) is checked for exactly-once the same way.
"""

from __future__ import annotations

import os
import time
import uuid

import pytest

from sims.faults import workload
from sims.faults.spark_protocol import spark_protocol_run
from testkit.history import check, fault_counts, load_history

LOCAL_RATES = {**workload.DEFAULT_RATES, "enospc": 0.01}
S3_RATES = {"fail_before": 0.02, "lost_ack": 0.06, "latency": 0.02}  # short runs: more faults per op


def run_and_check(url, options, history_dir, *, threads, ops, processes, process_ops, kills, rates, seed):
    os.makedirs(history_dir)
    workload.prepare(url, options)
    started = time.monotonic()
    workload.run_threads(url, options, history_dir, threads, ops, seed, rates, events=ops)
    killed = workload.kill_loop(url, options, history_dir, processes, process_ops, seed, rates, kills=kills,
                                deadline=40)
    history = load_history(history_dir)
    result = check(history, workload.final_state(url, options))
    injected = fault_counts(history)
    print(f"\n{url[:5]}: {result.summary()} kills={killed} faults={dict(injected)} "
          f"in {time.monotonic() - started:.1f} s")
    result.assert_valid()
    assert result.ok > 0 and result.reads > 0 and injected["lost_ack"] > 0 and injected["fail_before"] > 0
    return killed


def test_clients_under_faults_and_kills_local(tmp_path):
    killed = run_and_check(str(tmp_path / "store"), {}, str(tmp_path / "history"), threads=3, ops=60,
                           processes=3, process_ops=50, kills=3, rates=LOCAL_RATES, seed=20261123)
    assert killed >= 1


def test_clients_under_faults_and_kills_s3(tmp_path, s3_options):
    from tests.conftest import make_s3_url

    run_and_check(make_s3_url(s3_options), s3_options, str(tmp_path / "history"), threads=2, ops=20,
                  processes=2, process_ops=15, kills=1, rates=S3_RATES, seed=7)


@pytest.mark.parametrize("backend", ["memory", "local", "s3"])
@pytest.mark.parametrize("staged", [False, True], ids=["direct", "staged"])
def test_spark_write_protocol_exactly_once_under_faults(tmp_path, staged, backend, request):
    history = str(tmp_path / "history")
    os.makedirs(history)
    if backend == "s3":
        from tests.conftest import make_s3_url

        options = request.getfixturevalue("s3_options")
        url = make_s3_url(options)
    else:
        options = {}
        url = f"memory://spark-faults-{uuid.uuid4().hex}" if backend == "memory" else str(tmp_path / "store")
    committed = [spark_protocol_run(url, options, history, seed, S3_RATES, staged=staged) for seed in range(3)]
    state = workload.final_state(url, options, streams=tuple(f"spark{seed}" for seed in range(3)), segment=False)
    events = load_history(history)
    result = check(events, state)
    print(f"\nspark {'staged' if staged else 'direct'}: committed {committed}: {result.summary()} "
          f"faults={dict(fault_counts(events))}")
    result.assert_valid()
    assert any(committed) and fault_counts(events)["lost_ack"] > 0
