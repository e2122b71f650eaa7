// A real DBOS application on the TypeScript SDK (@dbos-inc/dbos-sdk 5.2), connected to Relay by
// the SDK's own conductor client: harness/executor_app.py's counterpart, with the same settings
// (RELAY_TEST_* in the environment). It prints "READY <executor id>" once DBOS has launched and
// its jobs have started, then runs until killed. RELAY_TEST_SEED=1 first leaves done-1, its child,
// failed-1 and waiting-1 in the system database (see seed()); RELAY_TEST_JOBS starts that many
// `job` workflows (job-0, ...), RELAY_TEST_SLEEPERS that many long `sleeper` ones.
// RELAY_TEST_JOBS_GATE holds the jobs back until that file exists (READY comes after them), as
// harness/executor_app.py does: a test opens it just before it kills the executor mid-job.
//
// For the retention, figures and alert tests (harness/alert_app.py's counterparts):
// - RELAY_TEST_FAILURES: that many `failing` workflows (failed-run-0, ...) run to their error;
// - RELAY_TEST_QUEUED: that many `quick` workflows (quick-0, ...) run through the queue `work`;
// - RELAY_TEST_HOLD_QUEUE: a `blocker` (waits an hour) and that many `quick` workflows (held-0, ...)
//   enqueued behind it on the queue `serial` (concurrency 1): they stay ENQUEUED;
// - RELAY_TEST_ALERTS: a PostgreSQL URL; the app's alert handler (DBOS.setAlertHandler) writes each
//   alert it receives as a row of alerts_received (name, message, metadata, executor id), as
//   harness/alert_app.py's does; RELAY_TEST_ALERTS_FAIL: the handler throws for that many alerts first.
//
// For the workflow API's routes (harness/workflow_app.py's seed, in small), RELAY_TEST_RICH=1 leaves:
// - rich-1 (`rich`, SUCCESS): six steps `add`, an event `progress`, a stream `log` with two values,
//   and a message `hello` on the topic `go`, sent to it and consumed;
// - the queue `serial` (concurrency 1), declared in the system database;
// - a schedule `every-hour` of the workflow `tick` (cron `0 * * * *`, context `ctx`), paused, lest
//   it start a run on the hour.
//
// Evidence (RELAY_TEST_EVIDENCE, a PostgreSQL URL), as the Python app writes it:
// - step_evidence: one row per execution of a step, keyed by (workflow id, step) but not unique
//   (a step is at-least-once, so a repeat shows as an extra row);
// - outcomes: written by a datasource transaction, which commits together with its checkpoint, so a
//   workflow's outcome appears exactly once (primary key).
'use strict';

const fs = require('node:fs');
const { DBOS } = require('@dbos-inc/dbos-sdk');
const datasource = require('@dbos-inc/dbos-sdk/datasource');
const { Pool } = require('pg');
const { SuperJSON } = require('superjson');

const ENV = process.env;
const EVIDENCE_URL = ENV.RELAY_TEST_EVIDENCE;
const APP = ENV.RELAY_TEST_APP;
const VERSION = ENV.RELAY_TEST_APP_VERSION || 'v1';

// The evidence (steps by (workflow, step), outcomes by a datasource transaction): harness/ts_evidence.js.
const { prepareEvidence, evidence, recordOutcome } = require('../ts_evidence').evidenceKit({
  DBOS, datasource, Pool, SuperJSON, url: EVIDENCE_URL, app: APP, version: VERSION,
});

const noteStep = DBOS.registerStep(async (n) => n, { name: 'noteStep' });

const job = DBOS.registerWorkflow(
  async (sleepSecs) => {
    await evidence('start');
    await DBOS.sleep(sleepSecs * 1000);
    await evidence('after_sleep');
    await recordOutcome(DBOS.workflowID);
    return 'done';
  },
  { name: 'job' },
);

const sleeper = DBOS.registerWorkflow(
  async (seconds) => {
    await noteStep(1);
    await DBOS.sleep(seconds * 1000);
    return 'slept';
  },
  { name: 'sleeper' },
);

// What RELAY_TEST_SEED=1 leaves in the system database (harness/workflow_app.py's, in small):
// done-1 (a step, a child done-1-child, an event; SUCCESS), failed-1 (ERROR) and waiting-1 (waits
// for a message: PENDING).
const add = DBOS.registerStep(async (a, b) => a + b, { name: 'add' });

const child = DBOS.registerWorkflow(async (n) => `child ${n}`, { name: 'child' });

const parent = DBOS.registerWorkflow(
  async (n) => {
    const sum = await add(n, n);
    const handle = await DBOS.startWorkflow(child, { workflowID: `${DBOS.workflowID}-child` })(sum);
    const got = await handle.getResult();
    await DBOS.setEvent('progress', sum);
    return `TOTAL ${sum} ${got}`;
  },
  { name: 'parent' },
);

const failing = DBOS.registerWorkflow(
  async (n) => {
    await add(n, 0);
    throw new Error(`failed on purpose with ${n}`);
  },
  { name: 'failing' },
);

const waiting = DBOS.registerWorkflow(async () => DBOS.recv('go', 3600), { name: 'waiting' });

const quick = DBOS.registerWorkflow(async (n) => add(n, 1), { name: 'quick' });

const blocker = DBOS.registerWorkflow(async () => DBOS.recv('never', 3600), { name: 'blocker' });

const rich = DBOS.registerWorkflow(
  async (n) => {
    let sum = 0;
    for (let i = 0; i < 6; i++) sum = await add(sum, n + i);
    await DBOS.setEvent('progress', `step ${sum}`);
    await DBOS.writeStream('log', 'first');
    await DBOS.writeStream('log', 'second');
    const got = await DBOS.recv('go', 60);
    return `RICH ${sum} ${got}`;
  },
  { name: 'rich' },
);

const tick = DBOS.registerWorkflow(async (scheduledDate, context) => `tick ${context}`, { name: 'tick' });

async function prepareAlerts(pool) {
  const client = await pool.connect();
  try {
    await client.query('BEGIN');
    await client.query('SELECT pg_advisory_xact_lock(43)');
    await client.query(`CREATE TABLE IF NOT EXISTS alerts_received (
        name text NOT NULL, message text NOT NULL, metadata jsonb NOT NULL, executor_id text NOT NULL,
        at timestamptz NOT NULL DEFAULT clock_timestamp())`);
    await client.query('COMMIT');
  } finally {
    client.release();
  }
}

async function work() {
  for (let i = 0; i < Number(ENV.RELAY_TEST_FAILURES || '0'); i++) {
    await (await DBOS.startWorkflow(failing, { workflowID: `failed-run-${i}` })(i)).getResult().catch(() => {});
  }
  const queued = Number(ENV.RELAY_TEST_QUEUED || '0');
  if (queued > 0) {
    await DBOS.registerQueue('work');
    const handles = [];
    for (let i = 0; i < queued; i++) {
      handles.push(await DBOS.startWorkflow(quick, { workflowID: `quick-${i}`, queueName: 'work' })(i));
    }
    for (const handle of handles) await handle.getResult();
  }
  const held = Number(ENV.RELAY_TEST_HOLD_QUEUE || '0');
  if (held > 0) {
    await DBOS.registerQueue('serial', { concurrency: 1 });
    await DBOS.startWorkflow(blocker, { workflowID: 'blocker-1', queueName: 'serial' })();
    for (let i = 0; i < held; i++) {
      await DBOS.startWorkflow(quick, { workflowID: `held-${i}`, queueName: 'serial' })(i);
    }
  }
}

async function seed() {
  await (await DBOS.startWorkflow(parent, { workflowID: 'done-1' })(1)).getResult();
  await (await DBOS.startWorkflow(failing, { workflowID: 'failed-1' })(3)).getResult().catch(() => {});
  await DBOS.startWorkflow(waiting, { workflowID: 'waiting-1' })();
}

async function seedRich() {
  await DBOS.registerQueue('serial', { concurrency: 1 });
  const handle = await DBOS.startWorkflow(rich, { workflowID: 'rich-1' })(1);
  await DBOS.send('rich-1', 'hello', 'go');
  await handle.getResult();
  if ((await DBOS.getSchedule('every-hour')) === null) {
    await DBOS.createSchedule({ scheduleName: 'every-hour', workflowFn: tick, schedule: '0 * * * *', context: 'ctx' });
  }
  await DBOS.pauseSchedule('every-hour');
}

async function untilFile(file) {
  while (!fs.existsSync(file)) await new Promise((resolve) => setTimeout(resolve, 100));
}

async function main() {
  if (EVIDENCE_URL) {
    await prepareEvidence();
  }
  if (ENV.RELAY_TEST_ALERTS) {
    const alerts = new Pool({ connectionString: ENV.RELAY_TEST_ALERTS, max: 2 });
    await prepareAlerts(alerts);
    let failures = Number(ENV.RELAY_TEST_ALERTS_FAIL || '0');
    DBOS.setAlertHandler(async (name, message, metadata) => {
      if (failures > 0) {
        failures -= 1;
        throw new Error(`alert handler failing on purpose (${name})`);
      }
      await alerts.query('INSERT INTO alerts_received (name, message, metadata, executor_id) VALUES ($1, $2, $3, $4)', [
        name,
        message,
        JSON.stringify(metadata),
        DBOS.executorID,
      ]);
    });
  }
  DBOS.setConfig({
    name: APP,
    systemDatabaseUrl: ENV.RELAY_TEST_SYSDB,
    systemDatabasePoolSize: 4,
    applicationVersion: VERSION,
    logLevel: ENV.RELAY_TEST_LOG_LEVEL || 'info',
  });
  await DBOS.launch({
    conductorURL: ENV.RELAY_TEST_CONDUCTOR_URL,
    conductorKey: ENV.RELAY_TEST_CONDUCTOR_KEY,
    conductorExecutorMetadata: { test: true },
  });
  if (ENV.RELAY_TEST_SEED) {
    await seed();
  }
  if (ENV.RELAY_TEST_RICH) {
    await seedRich();
  }
  await work();
  for (let i = 0; i < Number(ENV.RELAY_TEST_SLEEPERS || '0'); i++) {
    await DBOS.startWorkflow(sleeper)(3600);
  }
  if (ENV.RELAY_TEST_JOBS_GATE) await untilFile(ENV.RELAY_TEST_JOBS_GATE);
  const prefix = ENV.RELAY_TEST_JOB_PREFIX || 'job';
  for (let i = 0; i < Number(ENV.RELAY_TEST_JOBS || '0'); i++) {
    await DBOS.startWorkflow(job, { workflowID: `${prefix}-${i}` })(Number(ENV.RELAY_TEST_JOB_SLEEP || '2'));
  }
  process.stdout.write(`READY ${DBOS.executorID}\n`);
}

main().catch((err) => {
  process.stderr.write(`${err && err.stack ? err.stack : err}\n`);
  process.exit(1);
});
