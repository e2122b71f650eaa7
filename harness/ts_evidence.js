// The evidence both TypeScript test apps leave (harness/ts_app on SDK 5.2, harness/ts_app53 on 5.3),
// as harness/executor_app.py leaves it:
// - step_evidence: one row per execution of a step, keyed by (workflow id, step) but not unique (a
//   step is at-least-once, so a repeat shows as an extra row);
// - outcomes: written by a datasource transaction, which commits together with its checkpoint, so a
//   workflow's outcome appears exactly once (primary key).
// Each app passes its own SDK and packages: this file has no node_modules of its own, and a require
// here would find neither app's (nor the SDK version the app runs).
'use strict';

const { AsyncLocalStorage } = require('node:async_hooks');

/**
 * The data source, the tables' set-up, the `evidence` step and the `recordOutcome` transaction, registered
 * with the app's DBOS. `url`: the evidence database (none: no data source, and outcomes are not recorded).
 */
function evidenceKit({ DBOS, datasource, Pool, SuperJSON, url, app, version }) {
  // A transactional data source on node-postgres, after the SDK's data source contract
  // (@dbos-inc/dbos-sdk/datasource): the function's transaction also records its completion
  // (dbos.transaction_completion, keyed by workflow and step), checks that this execution still owns
  // the workflow, and commits both together; a step run again finds its completion and replays it.
  // DBOS's published data source packages (@dbos-inc/postgres-datasource 4.24, knex, drizzle) are
  // built for SDK 4 and do not load on 5.2 (they call schema helpers 5.x no longer exports).
  class EvidenceDataSource {
    constructor(name, url) {
      this.name = name;
      this.pool = new Pool({ connectionString: url, max: 4 });
      this.clients = new AsyncLocalStorage();
      datasource.registerDataSource(this);
    }

    async initialize() {
      const client = await this.pool.connect();
      try {
        await client.query('BEGIN');
        await datasource.initializeDataSourceSchemaPG(async (sql) => (await client.query(sql)).rows);
        await client.query('COMMIT');
      } catch (err) {
        await client.query('ROLLBACK');
        throw err;
      } finally {
        client.release();
      }
    }

    async destroy() {
      await this.pool.end();
    }

    // The transaction's client, inside a transaction function.
    get client() {
      return this.clients.getStore();
    }

    async recorded(workflowID, stepID) {
      const rows = await this.pool.query(
        'SELECT output, error FROM dbos.transaction_completion WHERE workflow_id = $1 AND function_num = $2',
        [workflowID, stepID],
      );
      return rows.rows[0];
    }

    async invokeTransactionFunction(_config, target, func, ...args) {
      const workflowID = DBOS.workflowID;
      const stepID = DBOS.stepID;
      const durable = workflowID !== undefined && stepID !== undefined;
      if (durable) {
        const done = await this.recorded(workflowID, stepID);
        if (done) return datasource.replayRecordedStep(done);
      }
      const client = await this.pool.connect();
      try {
        await client.query('BEGIN');
        const result = await this.clients.run(client, () => func.call(target, ...args));
        if (durable) {
          try {
            await client.query(
              'INSERT INTO dbos.transaction_completion (workflow_id, function_num, output) VALUES ($1, $2, $3)',
              [workflowID, stepID, SuperJSON.stringify(result)],
            );
          } catch (err) {
            // Only the completion's own conflict means another execution recorded the step first; a
            // conflict in the function's statements (a second outcome) is its error, not hidden.
            throw datasource.isPGKeyConflictError(err) ? new datasource.DBOSStepAlreadyRecordedError(workflowID, stepID) : err;
          }
          await datasource.assertStillOwnsWorkflow(workflowID);
        }
        await client.query('COMMIT');
        return result;
      } catch (err) {
        await client.query('ROLLBACK').catch(() => {});
        if (err instanceof datasource.DBOSStepAlreadyRecordedError) {
          // Another execution of the same step committed first: its outcome is the step's.
          const done = await this.recorded(workflowID, stepID);
          if (done) return datasource.replayRecordedStep(done);
        }
        throw err;
      } finally {
        client.release();
      }
    }
  }

  const ds = url ? new EvidenceDataSource('evidence', url) : undefined;

  async function prepareEvidence() {
    const client = await ds.pool.connect();
    try {
      await client.query('BEGIN');
      await client.query('SELECT pg_advisory_xact_lock(42)');
      await client.query(`CREATE TABLE IF NOT EXISTS step_evidence (
          workflow_id text NOT NULL, step text NOT NULL, executor_id text NOT NULL,
          app text NOT NULL, version text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`);
      await client.query(`CREATE TABLE IF NOT EXISTS outcomes (
          workflow_id text PRIMARY KEY, executor_id text NOT NULL, app text NOT NULL,
          version text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`);
      await client.query('COMMIT');
    } finally {
      client.release();
    }
  }

  const evidence = DBOS.registerStep(
    async (step) => {
      await ds.pool.query(
        'INSERT INTO step_evidence (workflow_id, step, executor_id, app, version) VALUES ($1, $2, $3, $4, $5)',
        [DBOS.workflowID, step, DBOS.executorID, app, version],
      );
    },
    { name: 'evidence' },
  );

  const recordOutcome = ds
    ? datasource.registerTransaction(
          'evidence',
          async (workflowId) => {
            await ds.client.query('INSERT INTO outcomes (workflow_id, executor_id, app, version) VALUES ($1, $2, $3, $4)', [
              workflowId,
              DBOS.executorID,
              app,
              version,
            ]);
          },
          { name: 'recordOutcome' },
        )
    : async () => {};

  return { ds, prepareEvidence, evidence, recordOutcome };
}

module.exports = { evidenceKit };
