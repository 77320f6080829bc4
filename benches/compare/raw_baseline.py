"""Raw Postgres yardstick for the comparison run: how fast this server commits
right now, so the engines' figures can be read against the machine's load.
  commit_p50_ms: one single-row INSERT + COMMIT on 1 connection, median of 500;
  commits_16conn_per_s: single-row INSERT commits over 16 connections for 3 s
  (Python threads with psycopg: the client may bind before the server does).
Creates and drops its own database. Prints `COMPARE engine=raw ...` lines.
"""

import os
import statistics
import threading
import time
from urllib.parse import urlsplit, urlunsplit

import psycopg

BASE_URL = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/postgres")
TAG = os.environ.get("RAW_TAG", "")


def out(metric: str, value: float) -> None:
    print(f"COMPARE engine=raw metric={metric}{TAG} value={round(value, 3)}", flush=True)


def main() -> None:
    name = f"durastep_cmp_raw_{os.getpid()}"
    u = urlsplit(BASE_URL)
    url = urlunsplit((u.scheme, u.netloc, "/" + name, u.query, u.fragment))
    with psycopg.connect(BASE_URL, autocommit=True) as c:
        c.execute(f"drop database if exists {name}")
        c.execute(f"create database {name}")
    try:
        with psycopg.connect(url, autocommit=True) as c:
            c.execute("create table t (id bigserial primary key, v int)")
            xs = []
            for i in range(550):
                t = time.perf_counter()
                c.execute("insert into t (v) values (%s)", (i,))
                xs.append((time.perf_counter() - t) * 1000)
            out("commit_p50_ms", statistics.median(xs[50:]))

        stop = time.perf_counter() + 3.0
        counts = [0] * 16

        def writer(k: int) -> None:
            with psycopg.connect(url, autocommit=True) as c:
                while time.perf_counter() < stop:
                    c.execute("insert into t (v) values (%s)", (k,))
                    counts[k] += 1

        threads = [threading.Thread(target=writer, args=(k,)) for k in range(16)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        out("commits_16conn_per_s", sum(counts) / 3.0)
    finally:
        with psycopg.connect(BASE_URL, autocommit=True) as c:
            c.execute(f"drop database if exists {name} with (force)")


if __name__ == "__main__":
    main()
