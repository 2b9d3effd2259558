"""The fault soak: the corruption fuzz at scale and a kill-loop soak under injected storage faults.

    python -m sims.faults.run [--trials 10000] [--kills 20] [--clients 3] [--ops 60] [--seed 0]

``--trials``: damage trials (``sims.faults.fuzz``: bit flips, zeroed ranges, truncations of the
chunks, chunk index files and newest batches/footers of a deep-tree index and a segment on local
disk), each under a timer; damage reaching the newest frame of a last chunk is counted apart, as a
newest-write rollback (docs/decisions/0001). ``--kills``: kill-loop rounds; each round runs segment
and ``EventWriter`` client processes over ``FaultyStorage`` (errors before the write, lost
acknowledgements, latency, a full disk) on a fresh local store, SIGKILLs them at random, restarts
them, and runs the history checker (``testkit.history``) over the round. Prints per attack: trials,
ok, project errors, newest-write rollbacks, wrong answers, non-project exceptions, hangs; per kill-loop: rounds, kills,
operations, duplicates, lost acknowledged writes, other violations. Exit code 1 if any trial was
wrong, crashed or hung, or any round broke a rule.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

from tqdm import tqdm

from testkit.history import check, fault_counts, load_history

from . import fuzz, workload

KILL_RATES = {**workload.DEFAULT_RATES, "enospc": 0.01, "torn": 0.01}


def run_fuzz(trials: int, seed: int, timeout: float, scratch: str) -> fuzz.Tally:
    pristines = [fuzz.build_index(os.path.join(scratch, "pristine-index")),
                 fuzz.build_index(os.path.join(scratch, "pristine-index-runs"), seed=3, runs=True),
                 fuzz.build_segment(os.path.join(scratch, "pristine-segment"))]
    trials_dir = os.path.join(scratch, "trials")
    os.makedirs(trials_dir)
    with tqdm(total=trials, desc="corruption fuzz", unit="trial") as bar:
        def progress(trial: fuzz.Trial) -> None:
            bar.update()
            if trial.outcome not in fuzz.ALLOWED:
                bar.write(trial.describe())
        return fuzz.fuzz(pristines, trials_dir, trials, first_seed=seed, timeout=timeout, progress=progress)


def run_kill_loop(rounds: int, clients: int, ops: int, seed: int, scratch: str) -> dict:
    totals = {"rounds": 0, "kills": 0, "ops": 0, "unknown": 0, "duplicates": 0, "lost": 0, "violations": 0,
              "lost_ack": 0, "fail_before": 0, "enospc": 0, "torn": 0}
    for n in tqdm(range(rounds), desc="kill loop", unit="round"):
        url, history = os.path.join(scratch, f"round-{n}", "store"), os.path.join(scratch, f"round-{n}", "history")
        os.makedirs(history)
        workload.prepare(url, {})
        kills = workload.kill_loop(url, {}, history, clients, ops, seed + n, KILL_RATES, kills=clients,
                                   deadline=120)
        events = load_history(history)
        result = check(events, workload.final_state(url, {}))
        injected = fault_counts(events)
        totals["rounds"] += 1
        totals["kills"] += kills
        totals["ops"] += result.ok + result.failed + result.unknown
        totals["unknown"] += result.unknown
        totals["duplicates"] += result.duplicates
        totals["lost"] += result.lost
        totals["violations"] += len(result.violations)
        for kind in ("lost_ack", "fail_before", "enospc", "torn"):
            totals[kind] += injected[kind]
        for violation in result.violations[:5]:
            tqdm.write(f"round {n} (seed {seed + n}): {violation}")
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10_000, help="corruption fuzz trials (default 10000)")
    parser.add_argument("--kills", type=int, default=10, help="kill-loop rounds (default 10; 0: none)")
    parser.add_argument("--clients", type=int, default=3, help="client processes per kill-loop round")
    parser.add_argument("--ops", type=int, default=60, help="operations per client life")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds a fuzz trial may take")
    args = parser.parse_args(argv)
    started = time.monotonic()
    failed = False
    with tempfile.TemporaryDirectory(prefix="attrindex-faults-") as scratch:
        if args.trials:
            tally = run_fuzz(args.trials, args.seed, args.timeout, scratch)
            print("\ncorruption fuzz (local disk)\n" + tally.table() + "\n" + tally.summary())
            failed |= bool(tally.bad)
        if args.kills:
            totals = run_kill_loop(args.kills, args.clients, args.ops, args.seed, scratch)
            print("\nkill loop (local disk, FaultyStorage, SIGKILL)")
            print("  ".join(f"{k} {v}" for k, v in totals.items()))
            failed |= bool(totals["violations"])
    print(f"\n{'FAILED' if failed else 'passed'} in {time.monotonic() - started:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
