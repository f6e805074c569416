// Drives graphile-worker, pg-boss or Restate for z29c's benchmark (crates/bench), each through
// its own documented API. The harness measures PostgreSQL, the sink and /proc from outside;
// this script only loads, works, serves and produces.
//
//   node peer.mjs <graphile-worker|pg-boss> load     '{"url":..,"jobs":N}'
//   node peer.mjs <graphile-worker|pg-boss> work     '{"url":..,"concurrency":C,"samples":"file","holdMs":0,"sink":URL}'
//   node peer.mjs <graphile-worker|pg-boss> produce  '{"url":..,"rate":R,"seconds":S}'
//   node peer.mjs restate serve '{"port":P,"sink":URL}'
//   node peer.mjs restate load  '{"admin":URL,"ingress":URL,"endpoint":URL,"jobs":N,"steps":S,"dueAt":EPOCH_MS}'
//
// `work` runs until SIGTERM (or SIGKILL), writing one line per started job to `samples`:
// "<job id> <start epoch ms> <intended epoch ms or -1>". Jobs carry their intended enqueue time
// (`t`) when produced open-loop, so queueing before the enqueue call is not hidden. With
// `sink`, each job makes one HTTP POST there and fails if it is not answered 2xx.
//
// Restate: `serve` is the service endpoint (its handler runs `steps` durable `ctx.run`s, each
// one POST to the sink); `load` registers it with the server and sends `jobs` invocations
// that all fall due at `dueAt` (Restate's delayed send), so a drain starts with all of them
// waiting, as the other systems' do.
import { appendFileSync, writeFileSync } from "node:fs";
import { performance } from "node:perf_hooks";

const [system, mode, argJson] = process.argv.slice(2);
const args = JSON.parse(argJson ?? "{}");
const QUEUE = "bench";
const now = () => performance.timeOrigin + performance.now();
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

function fail(message) {
  console.error(`peer.mjs: ${message}`);
  process.exit(2);
}
if (!["graphile-worker", "pg-boss", "restate"].includes(system)) fail(`unknown system ${system}`);
if (!["load", "work", "produce", "serve"].includes(mode)) fail(`unknown mode ${mode}`);
if (system !== "restate" && !args.url) fail("missing url");

// One POST to the sink, as every system's step makes it.
async function post(step) {
  const r = await fetch(args.sink, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ step }),
  });
  await r.arrayBuffer();
  if (!r.ok) throw new Error(`sink answered ${r.status}`);
  return r.status;
}

// One line per started job, buffered and appended to `args.samples` every 100 ms (and at once
// before a job that holds, so the harness sees it started).
function recorder() {
  let buffered = [];
  const flush = () => {
    if (buffered.length && args.samples) appendFileSync(args.samples, buffered.join(""));
    buffered = [];
  };
  setInterval(flush, 100).unref();
  const started = async (id, intended) => {
    buffered.push(`${id} ${now()} ${intended ?? -1}\n`);
    if (args.holdMs) {
      flush();
      await sleep(args.holdMs);
    }
    if (args.sink) await post(id);
  };
  return { started, flush };
}

// ---- graphile-worker ---------------------------------------------------------------------
async function graphile() {
  const gw = await import("graphile-worker");
  if (mode === "work") {
    const { started, flush } = recorder();
    // graphile-worker logs every job at INFO; the harness wants its stdout quiet
    const logger = new gw.Logger(() => (level, message) => {
      if (level === "error") console.error(message);
    });
    const runner = await gw.run({
      connectionString: args.url,
      logger,
      crontab: "",
      concurrency: args.concurrency,
      maxPoolSize: args.concurrency + 2,
      noHandleSignals: true,
      pollInterval: 2000,
      taskList: {
        [QUEUE]: (payload, helpers) => started(helpers.job.id, payload?.t),
      },
    });
    console.log(JSON.stringify({ event: "working" }));
    process.on("SIGTERM", async () => {
      flush();
      await runner.stop();
      process.exit(0);
    });
    await runner.promise;
    return;
  }
  const utils = await gw.makeWorkerUtils({
    connectionString: args.url,
    logger: new gw.Logger(() => () => {}),
  });
  await utils.migrate();
  if (mode === "load") {
    for (let done = 0; done < args.jobs; ) {
      const n = Math.min(1000, args.jobs - done);
      await utils.addJobs(Array.from({ length: n }, () => ({ identifier: QUEUE, payload: {} })));
      done += n;
    }
  } else {
    await produce((t) => utils.addJob(QUEUE, { t }));
  }
  await utils.release();
}

// ---- pg-boss -----------------------------------------------------------------------------
async function pgboss() {
  const { default: PgBoss } = await import("pg-boss");
  const boss = new PgBoss({
    connectionString: args.url,
    max: (args.concurrency ?? 1) + 2,
    // expiry is checked by maintenance: once a second, its minimum
    maintenanceIntervalSeconds: 1,
    supervise: mode === "work",
    schedule: false,
  });
  boss.on("error", (e) => console.error(`pg-boss: ${e.message}`));
  await boss.start();
  // a 5 s expiry, like z29c's bench lease; one retry brings an expired job back
  await boss.createQueue(QUEUE, { expireInSeconds: 5, retryLimit: 1, retryDelay: 0 });
  if (mode === "work") {
    const { started, flush } = recorder();
    // pg-boss 10 runs one fetch loop per work() call, and a loop waits out its polling interval
    // (0.5 s at least) after each fetch: concurrency C = C loops of one job each
    for (let i = 0; i < args.concurrency; i++) {
      await boss.work(QUEUE, { batchSize: 1, pollingIntervalSeconds: 0.5 }, ([job]) =>
        started(job.id, job.data?.t),
      );
    }
    console.log(JSON.stringify({ event: "working" }));
    process.on("SIGTERM", async () => {
      flush();
      await boss.stop({ graceful: true, wait: true, timeout: 5000 });
      process.exit(0);
    });
    return;
  }
  if (mode === "load") {
    for (let done = 0; done < args.jobs; ) {
      const n = Math.min(1000, args.jobs - done);
      await boss.insert(Array.from({ length: n }, () => ({ name: QUEUE, data: {} })));
      done += n;
    }
  } else {
    await produce((t) => boss.send(QUEUE, { t }));
  }
  await boss.stop({ graceful: false, wait: true });
}

// ---- Restate -------------------------------------------------------------------------------
async function restate() {
  if (mode === "serve") {
    // the SDK uses Promise.withResolvers, which Node 20 lacks
    if (!Promise.withResolvers) {
      Promise.withResolvers = () => {
        let resolve, reject;
        const promise = new Promise((a, b) => ((resolve = a), (reject = b)));
        return { promise, resolve, reject };
      };
    }
    const sdk = await import("@restatedev/restate-sdk");
    const service = sdk.service({
      name: "bench",
      handlers: {
        run: async (ctx, req) => {
          for (let i = 0; i < req.steps; i++) await ctx.run(`post ${i}`, () => post(i));
          return req.steps;
        },
      },
    });
    sdk.endpoint().bind(service).listen(args.port);
    return;
  }
  if (mode !== "load") fail(`restate has no mode ${mode}`);
  const register = await fetch(`${args.admin}/deployments`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ uri: args.endpoint }),
  });
  if (!register.ok) fail(`registering ${args.endpoint}: ${register.status} ${await register.text()}`);
  const body = JSON.stringify({ steps: args.steps });
  let next = 0;
  const sender = async () => {
    while (next < args.jobs) {
      next += 1;
      const delay = Math.max(0, Math.round(args.dueAt - now()));
      const r = await fetch(`${args.ingress}/bench/run/send?delay=${delay}ms`, {
        method: "POST",
        headers: { "content-type": "application/json" },
        body,
      });
      await r.arrayBuffer();
      if (!r.ok) fail(`send: ${r.status}`);
    }
  };
  await Promise.all(Array.from({ length: 32 }, sender));
  if (now() > args.dueAt) fail(`loading ended ${Math.round(now() - args.dueAt)} ms after the invocations fell due`);
}

// Open loop: job i is due at start + i/rate whatever happened to job i-1; its intended time
// travels with it.
async function produce(enqueue) {
  const start = now() + 200;
  const total = Math.round(args.rate * args.seconds);
  const pending = [];
  let failed = 0;
  for (let i = 0; i < total; i++) {
    const due = start + (i * 1000) / args.rate;
    const wait = due - now();
    if (wait > 1) await sleep(wait);
    pending.push(enqueue(due).catch(() => (failed += 1)));
  }
  await Promise.all(pending);
  console.log(JSON.stringify({ event: "produced", jobs: total, failed }));
}

try {
  if (system === "graphile-worker") await graphile();
  else if (system === "restate") await restate();
  else await pgboss();
  if (mode === "load") console.log(JSON.stringify({ event: "loaded", jobs: args.jobs }));
} catch (e) {
  fail(e.stack ?? String(e));
}
