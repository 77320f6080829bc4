// graphile-worker beside Durastep: no-op jobs/s, "10-step workflows"/s (a chain
// of 10 jobs, each adding the next), event-to-start latency. Replay does not
// apply (graphile-worker has no steps to replay).
//
// Creates a fresh database on DATABASE_URL's server, runs, drops it.
// Prints `COMPARE engine=graphile metric=<name> value=<number>` lines.
// Knobs: GW_JOBS (20000), GW_CHAINS (500), GW_LATENCY_SAMPLES (200), GW_CONCURRENCY (16).
import { createRequire } from "node:module";
import { fileURLToPath } from "node:url";
import path from "node:path";
import { performance } from "node:perf_hooks";

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, ".deps/node/package.json"));
const gw = await import(path.join(here, ".deps/node/node_modules/graphile-worker/dist/index.js"));
const pg = require("pg");
import { readFileSync } from "node:fs";
const gwVersion = JSON.parse(
  readFileSync(path.join(here, ".deps/node/node_modules/graphile-worker/package.json"), "utf8"),
).version;

const BASE_URL = process.env.DATABASE_URL || "postgres://postgres@127.0.0.1:5432/postgres";
const JOBS = Number(process.env.GW_JOBS || 20000);
const CHAINS = Number(process.env.GW_CHAINS || 500);
const LAT_SAMPLES = Number(process.env.GW_LATENCY_SAMPLES || 200);
const CONCURRENCY = Number(process.env.GW_CONCURRENCY || 16);

const dbName = `durastep_cmp_graphile_${process.pid}`;
const dbUrl = (() => {
  const u = new URL(BASE_URL);
  u.pathname = "/" + dbName;
  return u.toString();
})();

const silent = new gw.Logger(() => () => {});
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const out = (metric, value) =>
  console.log(`COMPARE engine=graphile metric=${metric} value=${Number(value.toFixed(3))}`);
const pct = (xs, p) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor((p / 100) * s.length))];
};

async function admin(sql) {
  const c = new pg.Client({ connectionString: BASE_URL });
  await c.connect();
  try {
    await c.query(sql);
  } finally {
    await c.end();
  }
}

async function waitEmpty(pool) {
  // A job is done when its row is gone (graphile-worker deletes completed jobs).
  for (;;) {
    const { rows } = await pool.query("select count(*)::int as n from graphile_worker._private_jobs");
    if (rows[0].n === 0) return;
    await sleep(5);
  }
}

function startRunner(taskList) {
  return gw.run({
    connectionString: dbUrl,
    concurrency: CONCURRENCY,
    maxPoolSize: CONCURRENCY + 4,
    noHandleSignals: true,
    pollInterval: 2000,
    logger: silent,
    taskList,
  });
}

async function main() {
  await admin(`drop database if exists ${dbName}`);
  await admin(`create database ${dbName}`);
  const pool = new pg.Pool({ connectionString: dbUrl, max: 4 });
  try {
    await gw.runMigrations({ connectionString: dbUrl, logger: silent });
    const utils = await gw.makeWorkerUtils({ connectionString: dbUrl, logger: silent });
    console.log(`# graphile-worker ${gwVersion}, node ${process.version}, concurrency ${CONCURRENCY} in one process`);

    // (a) no-op jobs: enqueue all first (addJobs, 1,000 per call), then drain.
    {
      let t = performance.now();
      for (let i = 0; i < JOBS; i += 1000) {
        const specs = [];
        for (let j = i; j < Math.min(JOBS, i + 1000); j++) specs.push({ identifier: "noop", payload: {} });
        await utils.addJobs(specs);
      }
      const enqS = (performance.now() - t) / 1000;
      t = performance.now();
      const runner = await startRunner({ noop: async () => {} });
      await waitEmpty(pool);
      const drainS = (performance.now() - t) / 1000;
      await runner.stop();
      out("enqueue_jobs_per_s", JOBS / enqS);
      out("noop_jobs_per_s", JOBS / drainS);
      console.log(`# (a) ${JOBS} no-op jobs: enqueue ${enqS.toFixed(2)} s, drain ${drainS.toFixed(2)} s`);
    }

    // (b) "10-step workflow" = a chain of 10 jobs; each job adds the next one
    // (helpers.addJob, its own transaction: not atomic with the completion).
    {
      for (let i = 0; i < CHAINS; i += 1000) {
        const specs = [];
        for (let j = i; j < Math.min(CHAINS, i + 1000); j++) specs.push({ identifier: "step", payload: { wf: j, i: 0 } });
        await utils.addJobs(specs);
      }
      let done = 0;
      let resolveAll;
      const all = new Promise((r) => (resolveAll = r));
      const t = performance.now();
      const runner = await startRunner({
        step: async (payload, helpers) => {
          if (payload.i < 9) {
            await helpers.addJob("step", { wf: payload.wf, i: payload.i + 1 });
          } else if (++done === CHAINS) {
            resolveAll();
          }
        },
      });
      await all;
      await waitEmpty(pool);
      const s = (performance.now() - t) / 1000;
      await runner.stop();
      out("chain10_per_s", CHAINS / s);
      out("chain10_jobs_per_s", (CHAINS * 10) / s);
      console.log(`# (b) ${CHAINS} chains of 10 jobs (enqueued first, drained at concurrency ${CONCURRENCY}): ${s.toFixed(2)} s`);
    }

    // (c) event-to-start: idle worker in this process (it hears the NOTIFY
    // through the server); time from the addJob call to the task function.
    {
      const starts = new Map();
      let resolveOne;
      const runner = await startRunner({
        lat: async (payload) => {
          const t1 = performance.now();
          starts.get(payload.k).t1 = t1;
          resolveOne();
        },
      });
      await sleep(1000);
      const lat = [];
      for (let k = 0; k < LAT_SAMPLES + 10; k++) {
        const started = new Promise((r) => (resolveOne = r));
        const rec = { t0: performance.now() };
        starts.set(k, rec);
        await utils.addJob("lat", { k });
        await started;
        if (k >= 10) lat.push(rec.t1 - rec.t0); // first 10 are warm-up
        await sleep(20);
      }
      await runner.stop();
      out("event_to_start_p50_ms", pct(lat, 50));
      out("event_to_start_p99_ms", pct(lat, 99));
      console.log(`# (c) ${lat.length} jobs one at a time to an idle worker: p50 ${pct(lat, 50).toFixed(2)} ms, p99 ${pct(lat, 99).toFixed(2)} ms`);
    }

    console.log("# (d) replay of 1,000 steps: not applicable (graphile-worker jobs have no steps to replay)");
    await utils.release();
  } finally {
    await pool.end();
    // A connection graphile-worker keeps idle in a pool of its own is ended by
    // the forced drop below (57P01); that is the teardown, not a failure.
    process.on("uncaughtException", (e) => {
      if (e && e.code === "57P01") return;
      throw e;
    });
    await admin(`drop database if exists ${dbName} with (force)`);
  }
}

await main();
