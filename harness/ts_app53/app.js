// A real DBOS application on the TypeScript SDK 5.3 (@dbos-inc/dbos-sdk 5.3.0), launched without a
// conductor key and connected to Relay by Relay's open client (client-ts/, @relay-oss/client): the
// counterpart of harness/ts_app (5.2, the SDK's own client), with the same settings (RELAY_TEST_* in
// the environment) and the same evidence. It prints "READY <executor id>" once DBOS has launched,
// the client is connected and its jobs have started, then runs until killed.
// - RELAY_TEST_JOBS starts that many `job` workflows (job-0, ...; RELAY_TEST_JOB_PREFIX, _SLEEP);
//   RELAY_TEST_JOBS_GATE holds them back until that file exists (READY comes after them), as
//   harness/executor_app.py does: a test opens it just before it kills the executor mid-job.
// - RELAY_TEST_FINISH_FILE: once that file exists, the app stops the client, shuts DBOS down and
//   prints "FINISHED <json>": whether @dbos-inc/dbos-enterprise was ever loaded (require.cache) or
//   can be found at all (require.resolve), whether the client is still running, and whether what
//   console.log, util.inspect or JSON.stringify showed of the connection just before held the key
//   (key_shown); then exits 0.
// - Its alert handler (DBOS.setAlertHandler) writes each alert as a line "ALERT <json>" to stderr,
//   then takes metadata.sleep_ms milliseconds (if given) to return: a request still being served.
// - RELAY_TEST_FINISH_FILE also prints "STOPPING" just before it stops the client.
// - RELAY_TEST_QUEUE=1: a queue `serial` (DBOS.registerQueue: concurrency 1, 5 per 2 s, partitioned
//   by a worker concurrency of 1 a partition).
// - RELAY_TEST_HOLD=1: a workflow `held-0` (of `held`) that waits an hour for a message: PENDING.
// - RELAY_TEST_OTHER_APP=1: a workflow `other-0` of `job` enqueued for the application `billing` (on
//   its queue `billing-jobs`, which this app does not serve: it stays ENQUEUED).
// - RELAY_TEST_SCHEDULE=1: a paused schedule `every-hour` of the workflow `tick` (context `ctx`).
// - RELAY_TEST_CA_FILE: the CA (PEM) the client trusts for a wss:// URL.
// - RELAY_TEST_CLIENT_OPTIONS: more options for connect(), as JSON (maxConcurrentRequests, ...).
// - RELAY_TEST_REFUSALS=1: launches DBOS with the executor id `local`, then with one not drawn by
//   newExecutorId(), tries connect() after each and prints "REFUSED <json>" with what connect()
//   threw each time; then exits 0.
// Evidence (RELAY_TEST_EVIDENCE, a PostgreSQL URL), as harness/ts_app writes it:
// - step_evidence: one row per execution of a step, keyed by (workflow id, step) but not unique;
// - outcomes: written by a datasource transaction, which commits together with its checkpoint, so a
//   workflow's outcome appears exactly once (primary key).
'use strict';

const fs = require('node:fs');
const util = require('node:util');
const { DBOS } = require('@dbos-inc/dbos-sdk');
const datasource = require('@dbos-inc/dbos-sdk/datasource');
const { Pool } = require('pg');
const { SuperJSON } = require('superjson');
const relay = require('@relay-oss/client');

const ENV = process.env;
const EVIDENCE_URL = ENV.RELAY_TEST_EVIDENCE;
const APP = ENV.RELAY_TEST_APP;
const VERSION = ENV.RELAY_TEST_APP_VERSION || 'v1';
const ENTERPRISE = '@dbos-inc/dbos-enterprise';

// The evidence, as harness/ts_app leaves it: harness/ts_evidence.js.
const { prepareEvidence, evidence, recordOutcome } = require('../ts_evidence').evidenceKit({
  DBOS, datasource, Pool, SuperJSON, url: EVIDENCE_URL, app: APP, version: VERSION,
});

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

const held = DBOS.registerWorkflow(async () => DBOS.recv('never', 3600), { name: 'held' });

const tick = DBOS.registerWorkflow(async (scheduledDate, context) => `tick ${context}`, { name: 'tick' });

// Executors of the tests start at once on one system database: its migrations run here first, one
// process at a time (two DBOS launches migrating together fail: "tuple concurrently updated"). The
// lock is tried, not waited for: a statement waiting for it would hold back the migrations' CREATE
// INDEX CONCURRENTLY, which waits for every open transaction, and the holder would never finish.
async function migrateSystemDatabase() {
  const pool = new Pool({ connectionString: ENV.RELAY_TEST_SYSDB, max: 1 });
  const client = await pool.connect();
  try {
    while (!(await client.query('SELECT pg_try_advisory_lock(44) AS got')).rows[0].got) {
      await new Promise((resolve) => setTimeout(resolve, 50));
    }
    await DBOS.migrate(ENV.RELAY_TEST_SYSDB);
    await client.query('SELECT pg_advisory_unlock(44)');
  } finally {
    client.release();
    await pool.end();
  }
}

function configure(executorID) {
  DBOS.setConfig({
    name: APP,
    systemDatabaseUrl: ENV.RELAY_TEST_SYSDB,
    systemDatabasePoolSize: 4,
    applicationVersion: VERSION,
    logLevel: ENV.RELAY_TEST_LOG_LEVEL || 'info',
    executorID,
  });
}

function connect() {
  const ca = ENV.RELAY_TEST_CA_FILE ? fs.readFileSync(ENV.RELAY_TEST_CA_FILE) : undefined;
  const tuning = JSON.parse(ENV.RELAY_TEST_CLIENT_OPTIONS || '{}');
  const options = { key: ENV.RELAY_TEST_CONDUCTOR_KEY, app: APP, metadata: { test: true }, ca, ...tuning };
  return relay.connect(ENV.RELAY_TEST_CONDUCTOR_URL, options);
}

function enterpriseReport() {
  let found = true;
  try {
    require.resolve(ENTERPRISE);
  } catch {
    found = false;
  }
  const loaded = Object.keys(require.cache).some((file) => file.includes(`${ENTERPRISE.replace('/', require('node:path').sep)}`));
  return { enterprise_loaded: loaded, enterprise_found: found };
}

// Whether what an application logging its connection (console.log, util.inspect, JSON.stringify) shows holds the key.
function keyShownBy(connection) {
  let json;
  try {
    json = JSON.stringify(connection);
  } catch (err) {
    json = String(err);
  }
  const shown = [util.inspect(connection), util.inspect(connection, { depth: 8 }), String(connection), json];
  return shown.some((text) => text.includes(ENV.RELAY_TEST_CONDUCTOR_KEY));
}

async function refusals() {
  const refused = {};
  for (const [label, executorID] of [['local', 'local'], ['typed', 'typed-in-a-config-file']]) {
    configure(executorID);
    await DBOS.launch();
    try {
      connect();
      refused[label] = null;
    } catch (err) {
      refused[label] = `${err.name}: ${err.message}`;
    }
    await DBOS.shutdown();
  }
  process.stdout.write(`REFUSED ${JSON.stringify(refused)}\n`);
}

async function untilFile(file) {
  while (!fs.existsSync(file)) await new Promise((resolve) => setTimeout(resolve, 100));
}

async function main() {
  if (ENV.RELAY_TEST_REFUSALS) {
    await refusals();
    return;
  }
  if (EVIDENCE_URL) {
    await prepareEvidence();
  }
  await migrateSystemDatabase();
  DBOS.setAlertHandler(async (name, message, metadata) => {
    process.stderr.write(`ALERT ${JSON.stringify({ name, message, metadata, executor: DBOS.executorID })}\n`);
    if (metadata.sleep_ms) await new Promise((resolve) => setTimeout(resolve, Number(metadata.sleep_ms)));
  });
  configure(relay.newExecutorId());
  await DBOS.launch();
  const connection = connect();
  if (ENV.RELAY_TEST_SCHEDULE && (await DBOS.getSchedule('every-hour')) === null) {
    // Paused at once, lest it start a run on the hour.
    await DBOS.createSchedule({ scheduleName: 'every-hour', workflowFn: tick, schedule: '0 * * * *', context: 'ctx' });
    await DBOS.pauseSchedule('every-hour');
  }
  if (ENV.RELAY_TEST_QUEUE) {
    const options = { concurrency: 1, rateLimit: { limitPerPeriod: 5, periodSec: 2 }, partitionWorkerConcurrency: 1 };
    await DBOS.registerQueue('serial', options);
  }
  if (ENV.RELAY_TEST_HOLD) await DBOS.startWorkflow(held, { workflowID: 'held-0' })();
  if (ENV.RELAY_TEST_OTHER_APP) {
    const other = { queueName: 'billing-jobs', workflowName: 'job', workflowID: 'other-0', applicationName: 'billing' };
    await DBOS.enqueueWorkflowWithOptions(other, 0);
  }
  if (ENV.RELAY_TEST_JOBS_GATE) await untilFile(ENV.RELAY_TEST_JOBS_GATE);
  const prefix = ENV.RELAY_TEST_JOB_PREFIX || 'job';
  for (let i = 0; i < Number(ENV.RELAY_TEST_JOBS || '0'); i++) {
    await DBOS.startWorkflow(job, { workflowID: `${prefix}-${i}` })(Number(ENV.RELAY_TEST_JOB_SLEEP || '2'));
  }
  process.stdout.write(`READY ${DBOS.executorID}\n`);
  if (ENV.RELAY_TEST_FINISH_FILE) {
    await untilFile(ENV.RELAY_TEST_FINISH_FILE);
    const keyShown = keyShownBy(connection);
    process.stdout.write('STOPPING\n');
    await connection.stop();
    await DBOS.shutdown();
    const report = { ...enterpriseReport(), client_running: connection.running, key_shown: keyShown };
    process.stdout.write(`FINISHED ${JSON.stringify(report)}\n`);
  }
}

main().catch((err) => {
  process.stderr.write(`${err && err.stack ? err.stack : err}\n`);
  process.exit(1);
});
