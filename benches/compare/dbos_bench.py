"""DBOS Transact (Python) beside Durastep.

Creates a fresh system database on DATABASE_URL's server, runs, drops it.
  (a) no-op workflows/s: DBOS_WORKFLOWS (5,000; 20,000 took too long on the loaded 2-core machine) single-step workflows enqueued
      first on a DBOS queue (worker_concurrency 16), then drained by one worker
      process (a child process of this script that listens on that queue only);
  (b) 10-step workflows/s: DBOS_CHAINS (500) workflows of 10 @DBOS.step calls,
      the same way;
  (c) event-to-start: enqueue -> workflow body starts, one at a time on an idle
      process (DBOS queues are polled; the interval is printed), and the same
      for DBOS.start_workflow (no queue);
  (d) replay of 1,000 steps: a workflow runs 1,000 steps, is cancelled before its
      1,001st, and DBOS.resume_workflow re-executes it: the 1,000 steps replay
      from their stored outputs; timed from the body's entry (and from the
      resume call) until the 1,001st step runs.
Prints `COMPARE engine=dbos metric=<name> value=<number>` lines.
"""

import importlib.metadata
import logging
import os
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit, urlunsplit

import psycopg
from dbos import DBOS, SetWorkflowID

BASE_URL = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
N_NOOP = int(os.environ.get("DBOS_WORKFLOWS", "5000"))
N_CHAINS = int(os.environ.get("DBOS_CHAINS", "500"))
LAT_SAMPLES = int(os.environ.get("DBOS_LATENCY_SAMPLES", "200"))
REPLAY_ROUNDS = int(os.environ.get("DBOS_REPLAY_ROUNDS", "3"))
CONCURRENCY = 16
# DBOS queues are polled (default 1 s). A short interval is set for the bench.
DRAIN_POLL_S = float(os.environ.get("DBOS_DRAIN_POLL_S", "0.001"))
LAT_POLL_S = float(os.environ.get("DBOS_LATENCY_POLL_S", "0.01"))


def db_url(name: str) -> str:
    u = urlsplit(BASE_URL)
    return urlunsplit((u.scheme, u.netloc, "/" + name, u.query, u.fragment))


def sa_url(url: str) -> str:
    return url.replace("postgres://", "postgresql+psycopg://", 1).replace(
        "postgresql://", "postgresql+psycopg://", 1
    )


def out(metric: str, value: float) -> None:
    print(f"COMPARE engine=dbos metric={metric} value={round(value, 3)}", flush=True)


def pct(xs, p):
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


# ---- workflows -------------------------------------------------------------

first_step_at: list = []


@DBOS.step()
def noop_step() -> None:
    if not first_step_at:
        first_step_at.append(time.perf_counter())


@DBOS.workflow()
def noop_wf() -> None:
    noop_step()


@DBOS.step()
def chain_step(i: int) -> int:
    return i


@DBOS.workflow()
def chain_wf() -> None:
    for i in range(10):
        chain_step(i)


lat_seen: dict = {}
lat_event = threading.Event()


@DBOS.workflow()
def lat_wf(k: int) -> None:
    lat_seen[k] = time.perf_counter()
    lat_event.set()


replay_state: dict = {}


@DBOS.step()
def replay_step(i: int) -> int:
    return i


@DBOS.step()
def replay_action() -> None:
    st = replay_state[DBOS.workflow_id]
    st["action"] = time.perf_counter()
    st["action_ev"].set()


@DBOS.workflow()
def replay_wf() -> None:
    st = replay_state[DBOS.workflow_id]
    st.setdefault("entries", []).append(time.perf_counter())
    for i in range(1000):
        replay_step(i)
    if len(st["entries"]) == 1:
        # First execution: tell the driver the 1,000 steps are stored, and wait
        # until it has cancelled this workflow; the next step then stops it.
        st["stored_ev"].set()
        st["go_ev"].wait()
    replay_action()


class _QuietExpectedCancel(logging.Filter):
    """Drops DBOS's error log of the first replay execution, which the bench
    cancels on purpose before its 1,001st step."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return "Cancelled" not in type(exc).__name__


def make_dbos(dbname: str, listen: list) -> None:
    DBOS(
        config={
            "name": "durastep-compare",
            "system_database_url": sa_url(db_url(dbname)),
            "application_version": "compare-1",
            "executor_id": f"exec-{os.getpid()}",
            "sys_db_pool_size": CONCURRENCY + 8,
            "log_level": "ERROR",
        }
    )
    DBOS.listen_queues(listen)
    DBOS.launch()
    for h in logging.getLogger("dbos").handlers:
        h.addFilter(_QuietExpectedCancel())
    # Queues are registered (persisted) after launch.
    DBOS.register_queue("bench", worker_concurrency=CONCURRENCY, polling_interval_sec=DRAIN_POLL_S)
    DBOS.register_queue("lat", worker_concurrency=CONCURRENCY, polling_interval_sec=LAT_POLL_S)


def count_done(dbname: str, name: str) -> int:
    with psycopg.connect(db_url(dbname), autocommit=True) as c:
        return c.execute(
            "select count(*) from dbos.workflow_status where name like %s and status = 'SUCCESS'",
            ("%" + name,),
        ).fetchone()[0]


# ---- child: one worker process that drains the "bench" queue ----------------


def child_drain(dbname: str, name: str, n: int) -> None:
    t0 = time.perf_counter()
    make_dbos(dbname, ["bench"])
    launched = time.perf_counter()
    with psycopg.connect(db_url(dbname), autocommit=True) as c:
        while True:
            done = c.execute(
                "select count(*) from dbos.workflow_status where name like %s and status = 'SUCCESS'",
                ("%" + name,),
            ).fetchone()[0]
            if done >= n:
                break
            time.sleep(0.01)
    t1 = time.perf_counter()
    print(f"DRAIN seconds={t1 - launched} with_launch={t1 - t0}", flush=True)
    DBOS.destroy()
    os._exit(0)


def enqueue_many(fn, n: int) -> float:
    q = DBOS.retrieve_queue("bench")
    t = time.perf_counter()
    with ThreadPoolExecutor(8) as ex:
        list(ex.map(lambda _: q.enqueue(fn), range(n), chunksize=256))
    return time.perf_counter() - t


def drain_in_child(dbname: str, name: str, n: int) -> float:
    p = subprocess.run(
        [sys.executable, __file__, "--drain", dbname, name, str(n)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    for line in p.stdout.splitlines():
        if line.startswith("DRAIN "):
            return float(line.split()[1].split("=")[1])
    sys.stderr.write(p.stdout + p.stderr)
    raise SystemExit("drain child failed")


def main() -> None:
    dbname = f"durastep_cmp_dbos_{os.getpid()}"
    with psycopg.connect(BASE_URL, autocommit=True) as c:
        c.execute(f"drop database if exists {dbname}")
        c.execute(f"create database {dbname}")
    try:
        make_dbos(dbname, ["lat"])
        print(
            f"# dbos {importlib.metadata.version('dbos')}, python {sys.version.split()[0]}, "
            f"queue worker_concurrency {CONCURRENCY}, drain queue polled every {DRAIN_POLL_S} s, "
            f"latency queue every {LAT_POLL_S} s",
            flush=True,
        )

        # (a) no-op single-step workflows
        enq = enqueue_many(noop_wf, N_NOOP)
        drain = drain_in_child(dbname, "noop_wf", N_NOOP)
        out("enqueue_workflows_per_s", N_NOOP / enq)
        out("noop_workflows_per_s", N_NOOP / drain)
        print(f"# (a) {N_NOOP} single-step workflows: enqueue {enq:.2f} s (8 threads), drain {drain:.2f} s", flush=True)

        # (b) 10-step workflows
        enq = enqueue_many(chain_wf, N_CHAINS)
        drain = drain_in_child(dbname, "chain_wf", N_CHAINS)
        out("wf10_per_s", N_CHAINS / drain)
        out("wf10_steps_per_s", N_CHAINS * 10 / drain)
        print(f"# (b) {N_CHAINS} workflows of 10 steps: enqueue {enq:.2f} s, drain {drain:.2f} s", flush=True)

        # (c) event-to-start on an idle process
        time.sleep(1.0)
        q = DBOS.retrieve_queue("lat")
        for label, start in (
            ("queue", lambda k: q.enqueue(lat_wf, k)),
            ("start_workflow", lambda k: DBOS.start_workflow(lat_wf, k)),
        ):
            lat = []
            for k in range(LAT_SAMPLES + 10):
                key = (label, k)
                lat_event.clear()
                t0 = time.perf_counter()
                start(key)
                lat_event.wait(10)
                if k >= 10:
                    lat.append((lat_seen[key] - t0) * 1000)
                time.sleep(0.02)
            metric = "event_to_start" if label == "queue" else "start_workflow_to_start"
            out(f"{metric}_p50_ms", pct(lat, 50))
            out(f"{metric}_p99_ms", pct(lat, 99))
            print(f"# (c) {label}: {len(lat)} samples, p50 {pct(lat, 50):.2f} ms, p99 {pct(lat, 99):.2f} ms", flush=True)

        # (d) replay of 1,000 stored steps after resume
        body, total, first = [], [], []
        for r in range(REPLAY_ROUNDS):
            wid = f"replay-{r}-{os.getpid()}"
            st = replay_state[wid] = {
                "stored_ev": threading.Event(),
                "go_ev": threading.Event(),
                "action_ev": threading.Event(),
            }
            t = time.perf_counter()
            with SetWorkflowID(wid):
                DBOS.start_workflow(replay_wf)
            if not st["stored_ev"].wait(300):
                raise SystemExit("replay workflow did not store its steps")
            first.append(time.perf_counter() - t)
            DBOS.cancel_workflow(wid)
            st["go_ev"].set()
            time.sleep(0.5)
            if "action" in st:
                raise SystemExit("the cancelled workflow ran its 1,001st step")
            t0 = time.perf_counter()
            handle = DBOS.resume_workflow(wid, queue_name="lat")
            if not st["action_ev"].wait(120):
                raise SystemExit("resumed workflow did not reach its 1,001st step")
            handle.get_result()
            assert len(st["entries"]) == 2, st["entries"]
            body.append((st["action"] - st["entries"][1]) * 1000)
            total.append((st["action"] - t0) * 1000)
        out("replay_1000_ms", statistics.median(body))
        out("resume_to_action_1001_ms", statistics.median(total))
        print(
            f"# (d) {REPLAY_ROUNDS} rounds: first execution of 1,000 steps {statistics.median(first):.2f} s; "
            f"replay (body entry -> 1,001st step) median {statistics.median(body):.1f} ms; "
            f"resume call -> 1,001st step median {statistics.median(total):.1f} ms",
            flush=True,
        )
    finally:
        DBOS.destroy()
        with psycopg.connect(BASE_URL, autocommit=True) as c:
            c.execute(f"drop database if exists {dbname} with (force)")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--drain":
        child_drain(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
