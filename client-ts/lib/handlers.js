'use strict';

// The executor's answers: one small handler per message type, dispatched through a table (ROUTES).
//
// answer(text) takes a frame's text and resolves to the reply's text, or undefined for a frame that
// cannot be addressed (not JSON, no type or request id: logged and dropped). Field names and shapes
// are the protocol's (Relay's protocol/relay_protocol: messages.py, bodies.py, outputs.py).
//
// - A type not in ROUTES is answered as an SDK that does not know it answers: the request's type
//   and id and error_message "Unknown message type", nothing else.
// - A request whose fields are not what its type needs gets an error reply naming the field.
// - A handler that throws is answered with its type's failure reply: the payload empty
//   (success: false, exist: false, output: [] or null) and error_message saying what failed, in the
//   5.2 SDK's own client's words: `${context}: ${error.message}`, the context as 5.2 has it for that
//   type ("Exception encountered when cancelling workflow(s) a,b"), so an operator reads the same text
//   from both; a thrown value with no message (a string, an Error("")) is named, where 5.2 says
//   "undefined" or nothing (reasonOf). The log line has the stack too.
// - A workflow's or step's error is sent as 5.2 sends it: JSON.stringify(serializeError(error)), with
//   the serialize-error the SDK itself uses; a schedule's context, when asked for, is always inspected
//   as 5.2 inspects it ("null" for none), and every inspected value with 5.2's options.
//
// Every handler calls DBOS's public API (DBOS.listWorkflows, DBOS.cancelWorkflows, ...; retention and
// the aggregates in lib/retention.js and lib/aggregates.js, from its listings), except
// recovery, which calls DBOSExecutor.globalInstance.recoverPendingWorkflows(ids): the entry point the
// SDK's own clients used, not part of the DBOS class.
//
// Answered "Unknown message type" (no route): get_workflow_events, get_workflow_notifications and
// get_workflow_streams (5.3's public API reads one event, message or stream by key but lists none of
// a workflow's keys), export_workflow and import_workflow (no public API exports or writes its rows).

const os = require('node:os');
const path = require('node:path');
const fs = require('node:fs');
const { inspect } = require('node:util');
const { DBOS } = require('@dbos-inc/dbos-sdk');
const { randomUUID } = require('node:crypto');
const { serializeError } = require('serialize-error');
const { Retention } = require('./retention');
const aggregates = require('./aggregates');

const { defined } = aggregates;

const UNKNOWN_TYPE = 'Unknown message type';

class BadRequest extends Error {}

/** The version of the @dbos-inc/dbos-sdk this process runs (its package.json, next to its dist/). */
function dbosVersion() {
  try {
    let dir = path.dirname(require.resolve('@dbos-inc/dbos-sdk'));
    for (let i = 0; i < 5; i++, dir = path.dirname(dir)) {
      const manifest = path.join(dir, 'package.json');
      if (fs.existsSync(manifest)) {
        const parsed = JSON.parse(fs.readFileSync(manifest, 'utf8'));
        if (parsed.name === '@dbos-inc/dbos-sdk') return String(parsed.version);
      }
    }
  } catch {
    // fall through
  }
  return 'unknown';
}

function dbosInternal(name) {
  return require(`@dbos-inc/dbos-sdk/internal/${name}`);
}

// --- Reading a request's fields ---

// `fallback`: REQUIRED (the default), or what a missing or null field reads as (OPTIONAL: undefined).
function field(frame, key, check, what, fallback) {
  const value = frame[key];
  if (value === undefined || value === null) {
    if (fallback === REQUIRED) throw new BadRequest(`${frame.type}: the field ${key} is missing`);
    return fallback === OPTIONAL ? undefined : fallback;
  }
  if (!check(value)) throw new BadRequest(`${frame.type}: the field ${key} must be ${what}`);
  return value;
}

const REQUIRED = Symbol('required');
const OPTIONAL = Symbol('optional');
const isStr = (v) => typeof v === 'string';
const isBool = (v) => typeof v === 'boolean';
const isInt = (v) => Number.isSafeInteger(v);
const isStrList = (v) => Array.isArray(v) && v.every(isStr);
const isStrOrList = (v) => isStr(v) || isStrList(v);
const isObject = (v) => typeof v === 'object' && !Array.isArray(v);

const str = (f, k, d = REQUIRED) => field(f, k, isStr, 'a string', d);
const bool = (f, k, d = REQUIRED) => field(f, k, isBool, 'true or false', d);
const int = (f, k, d = REQUIRED) => field(f, k, isInt, 'an integer', d);
const strList = (f, k, d = REQUIRED) => field(f, k, isStrList, 'a list of strings', d);
const strOrList = (f, k, d = REQUIRED) => field(f, k, isStrOrList, 'a string or a list of strings', d);
const object = (f, k, d = REQUIRED) => field(f, k, isObject, 'an object', d);

function body(frame) {
  return { type: frame.type, ...object(frame, 'body') };
}

/** One id or several: the request's workflow_ids when given and not empty, else its workflow_id. */
function ids(frame) {
  const many = strList(frame, 'workflow_ids', OPTIONAL);
  return many && many.length > 0 ? many : [str(frame, 'workflow_id')];
}

/** An empty list is no filter (as the Python SDK reads it), not "IN ()". Not for application_name,
 * whose empty list DBOS reads as every application and whose absence as this one. */
function filter(value) {
  return Array.isArray(value) && value.length === 0 ? undefined : value;
}

/** A list_workflows / list_queued_workflows body as DBOS's GetWorkflowsInput. */
function workflowsInput(b) {
  const input = {
    workflowIDs: filter(strList(b, 'workflow_uuids', OPTIONAL)),
    workflowName: filter(strOrList(b, 'workflow_name', OPTIONAL)),
    authenticatedUser: filter(strOrList(b, 'authenticated_user', OPTIONAL)),
    startTime: str(b, 'start_time', OPTIONAL),
    endTime: str(b, 'end_time', OPTIONAL),
    completedAfter: str(b, 'completed_after', OPTIONAL),
    completedBefore: str(b, 'completed_before', OPTIONAL),
    dequeuedAfter: str(b, 'dequeued_after', OPTIONAL),
    dequeuedBefore: str(b, 'dequeued_before', OPTIONAL),
    status: filter(strOrList(b, 'status', OPTIONAL)),
    applicationVersion: filter(strOrList(b, 'application_version', OPTIONAL)),
    forkedFrom: filter(strOrList(b, 'forked_from', OPTIONAL)),
    parentWorkflowID: filter(strOrList(b, 'parent_workflow_id', OPTIONAL)),
    queueName: filter(strOrList(b, 'queue_name', OPTIONAL)),
    limit: int(b, 'limit', OPTIONAL),
    offset: int(b, 'offset', OPTIONAL),
    sortDesc: bool(b, 'sort_desc', false),
    workflow_id_prefix: filter(strOrList(b, 'workflow_id_prefix', OPTIONAL)),
    loadInput: bool(b, 'load_input', true),
    loadOutput: bool(b, 'load_output', true),
    executorId: filter(strOrList(b, 'executor_id', OPTIONAL)),
    wasForkedFrom: bool(b, 'was_forked_from', OPTIONAL),
    hasParent: bool(b, 'has_parent', OPTIONAL),
    attributes: object(b, 'attributes', OPTIONAL),
    scheduleName: filter(strOrList(b, 'schedule_name', OPTIONAL)),
    applicationName: strOrList(b, 'application_name', OPTIONAL), // [] is every application's, as DBOS reads it
  };
  if (bool(b, 'queues_only', false)) input.queuesOnly = true;
  defined(input);
  return input;
}

// --- Building a reply's values ---

const text = (value) => (value === undefined || value === null ? null : String(value));
// The 5.2 SDK's inspectForConductor (conductor/protocol.js): nothing collapsed or cut.
const INSPECT_OPTIONS = { depth: null, maxArrayLength: null, maxStringLength: null };
const inspected = (value) => inspect(value, INSPECT_OPTIONS);
// A workflow's input and output, a step's output and either's error are sent, as 5.2 sends them
// (`info.output ? inspectForConductor(info.output) : undefined`), only when truthy: a workflow that
// returned 0, '' or false shows no output from a 5.2 executor, and none from this client either.
const shown = (value) => (value ? inspected(value) : null);

/** A workflow's or step's error as the 5.2 SDK's client sends it (WorkflowsOutput.Error, WorkflowSteps.error). */
function errorText(error) {
  if (!error) return null;
  return JSON.stringify(serializeError(error));
}

/** A DBOS WorkflowStatus as the protocol's WorkflowsOutput (PascalCase keys; numbers as strings). */
function workflowOutput(w) {
  const roles = w.authenticatedRoles ?? [];
  return {
    WorkflowUUID: w.workflowID,
    Status: text(w.status),
    WorkflowName: text(w.workflowName),
    WorkflowClassName: w.workflowClassName || null,
    WorkflowConfigName: w.workflowConfigName || null,
    AuthenticatedUser: w.authenticatedUser || null,
    AssumedRole: w.assumedRole || null,
    AuthenticatedRoles: roles.length > 0 ? JSON.stringify(roles) : null,
    Input: shown(w.input),
    Output: shown(w.output),
    Error: errorText(w.error),
    CreatedAt: text(w.createdAt),
    UpdatedAt: text(w.updatedAt),
    QueueName: w.queueName || null,
    ApplicationVersion: text(w.applicationVersion),
    ExecutorID: text(w.executorId),
    WorkflowTimeoutMS: text(w.timeoutMS),
    WorkflowDeadlineEpochMS: text(w.deadlineEpochMS),
    DeduplicationID: text(w.deduplicationID),
    Priority: text(w.priority),
    QueuePartitionKey: text(w.queuePartitionKey),
    ForkedFrom: text(w.forkedFrom),
    WasForkedFrom: w.wasForkedFrom ?? false,
    ParentWorkflowID: text(w.parentWorkflowID),
    DequeuedAt: text(w.dequeuedAt),
    DelayUntilEpochMS: text(w.delayUntilEpochMS),
    CompletedAt: text(w.completedAt),
    Attributes: w.attributes === undefined || w.attributes === null ? null : JSON.stringify(w.attributes),
    ScheduleName: text(w.scheduleName),
    ApplicationName: text(w.applicationName),
  };
}

function stepOutput(s, loadOutput) {
  return {
    function_id: s.functionID,
    function_name: s.name,
    output: loadOutput ? shown(s.output) : null,
    error: loadOutput ? errorText(s.error) : null,
    child_workflow_id: s.childWorkflowID ?? null,
    started_at_epoch_ms: text(s.startedAtEpochMs),
    completed_at_epoch_ms: text(s.completedAtEpochMs),
  };
}

// --- The handlers: ROUTES[type] = { handle(frame, ctx) -> reply fields, failure reply fields, context } ---

const ROUTES = new Map();

/** `context`: what a failure's error_message begins with, the 5.2 SDK's client's words for the type:
 * a string, or a function of the frame for the contexts that name what was asked (ids, names). */
function route(type, failed, context, handle) {
  ROUTES.set(type, { handle, failed, context: typeof context === 'function' ? context : () => context });
}

const when = (what) => `Exception encountered when ${what}`;
/** The frame's body, or {} (a context is worded from what the frame has, never failing on it). */
const bodyOf = (f) => (isObject(f.body) && f.body !== null ? f.body : {});

/** 5.2's context for cancel, delete and resume: the ids as it reads them (`workflow_ids ?? [workflow_id]`). */
const idsContext = (what) => (f) => when(`${what} workflow(s) ${String(f.workflow_ids ?? [f.workflow_id])}`);

const unsuccessful = { success: false };

route('executor_info', { executor_id: 'unknown', application_version: '' }, when('reporting executor info'), async (f, ctx) => ({
  executor_id: ctx.executorId,
  application_version: DBOS.applicationVersion,
  hostname: os.hostname(),
  language: 'typescript',
  dbos_version: ctx.dbosVersion,
  executor_metadata: ctx.metadata ?? null,
}));

route('recovery', unsuccessful, when('recovering workflows'), async (f, ctx) => {
  const executorIds = strList(f, 'executor_ids');
  const { DBOSExecutor } = dbosInternal('dbos-executor');
  const executor = DBOSExecutor.globalInstance;
  if (!executor) throw new Error('DBOS is not launched');
  const handles = await executor.recoverPendingWorkflows(executorIds);
  ctx.log.info(`relay client: recovered ${handles.length} workflows of executors ${executorIds.join(', ')}`);
  return { success: true };
});

route('exist_pending_workflows', { exist: false }, when('checking for pending workflows'), async (f) => {
  const pending = await DBOS.listWorkflows({
    status: 'PENDING',
    executorId: str(f, 'executor_id'),
    applicationVersion: str(f, 'application_version'),
    limit: 1,
    loadInput: false,
    loadOutput: false,
  });
  return { exist: pending.length > 0 };
});

route('retention', unsuccessful, when('enforcing retention policy'), async (f, ctx) => {
  const b = body(f);
  const round = {};
  for (const key of ['gc_cutoff_epoch_ms', 'gc_rows_threshold', 'gc_batch_size', 'timeout_cutoff_epoch_ms']) {
    round[key] = int(b, key, null);
  }
  ctx.retention.start(round); // a round still running means this one is skipped, as the SDK did
  return { success: true };
});

route('alert', unsuccessful, 'Exception in alert handler', async (f, ctx) => {
  const name = str(f, 'name');
  const message = str(f, 'message');
  const metadata = object(f, 'metadata', {});
  const handler = dbosInternal('decorators').getAlertHandler?.();
  if (handler) {
    await handler(name, message, metadata);
  } else {
    ctx.log.info(`relay client: Alert: ${name} | Message: ${message} | Metadata: ${JSON.stringify(metadata)}`);
  }
  return { success: true };
});

route('list_workflows', { output: [] }, when('listing workflows'), async (f) => ({
  output: (await DBOS.listWorkflows(workflowsInput(body(f)))).map(workflowOutput),
}));

route('list_queued_workflows', { output: [] }, when('listing queued workflows'), async (f) => ({
  output: (await DBOS.listQueuedWorkflows(workflowsInput(body(f)))).map(workflowOutput),
}));

route('get_workflow', { output: null }, (f) => when(`getting workflow ${f.workflow_id}`), async (f) => {
  const found = await DBOS.listWorkflows({
    workflowIDs: [str(f, 'workflow_id')],
    loadInput: bool(f, 'load_input', true),
    loadOutput: bool(f, 'load_output', true),
  });
  return { output: found.length > 0 ? workflowOutput(found[0]) : null };
});

route('list_steps', { output: null }, (f) => when(`listing steps ${f.workflow_id}`), async (f) => {
  const loadOutput = bool(f, 'load_output', true);
  const options = { limit: int(f, 'limit', OPTIONAL), offset: int(f, 'offset', OPTIONAL) };
  defined(options);
  const steps = await DBOS.listWorkflowSteps(str(f, 'workflow_id'), options);
  return { output: steps === undefined ? null : steps.map((s) => stepOutput(s, loadOutput)) };
});

route('cancel', unsuccessful, idsContext('cancelling'), async (f) => {
  await DBOS.cancelWorkflows(ids(f), { cancelChildren: bool(f, 'cancel_children', false) });
  return { success: true };
});

route('delete', unsuccessful, idsContext('deleting'), async (f) => {
  await DBOS.deleteWorkflows(ids(f), bool(f, 'delete_children', false));
  return { success: true };
});

route('resume', unsuccessful, idsContext('resuming'), async (f) => {
  const queueName = str(f, 'queue_name', OPTIONAL);
  await DBOS.resumeWorkflows(ids(f), queueName ? { queueName } : undefined);
  return { success: true };
});

function forkContext(f) {
  const b = bodyOf(f);
  return when(
    `forking workflow ${b.workflow_id} to new workflow ${b.new_workflow_id} on step ${b.start_step}, ` +
      `app version ${b.application_version}`,
  );
}

route('fork_workflow', { new_workflow_id: null }, forkContext, async (f) => {
  const b = body(f);
  const options = {
    newWorkflowID: str(b, 'new_workflow_id', OPTIONAL),
    applicationVersion: str(b, 'application_version', OPTIONAL),
    queueName: str(b, 'queue_name', OPTIONAL),
    queuePartitionKey: str(b, 'queue_partition_key', OPTIONAL),
  };
  defined(options);
  const handle = await DBOS.forkWorkflow(str(b, 'workflow_id'), int(b, 'start_step'), options);
  return { new_workflow_id: handle.workflowID };
});

/** The step a workflow is forked from: the given one, the last of a name, the last failed, or the last. */
async function startStep(workflowId, fromStep, fromStepName, fromLastFailure) {
  if (fromStep !== undefined) return fromStep;
  const steps = (await DBOS.listWorkflowSteps(workflowId)) ?? [];
  if (fromStepName !== undefined) {
    const named = steps.filter((s) => s.name === fromStepName).map((s) => s.functionID);
    if (named.length === 0) throw new Error(`Workflow ${workflowId} has no step named '${fromStepName}'`);
    return Math.max(...named);
  }
  const failing = steps.filter((s) => s.error !== undefined && s.error !== null);
  const failed = fromLastFailure ? failing.map((s) => s.functionID) : [];
  const all = steps.map((s) => s.functionID);
  return Math.max(...(failed.length > 0 ? failed : all.length > 0 ? all : [1]));
}

route('fork_from_failure', { forked_workflow_ids: null }, when('bulk forking workflows'), async (f) => {
  const b = body(f);
  const workflowIds = strList(b, 'workflow_ids');
  const fromLastFailure = bool(b, 'from_last_failure', false);
  const fromLastStep = bool(b, 'from_last_step', false);
  const fromStep = int(b, 'from_step', OPTIONAL);
  const fromStepName = str(b, 'from_step_name', OPTIONAL);
  const options = {
    applicationVersion: str(b, 'application_version', OPTIONAL),
    queueName: str(b, 'queue_name', OPTIONAL),
    queuePartitionKey: str(b, 'queue_partition_key', OPTIONAL),
  };
  defined(options);
  const modes = [fromLastFailure, fromLastStep, fromStep !== undefined, fromStepName !== undefined];
  if (modes.filter(Boolean).length !== 1) {
    throw new Error('Exactly one of from_last_failure, from_last_step, from_step, or from_step_name must be specified');
  }
  // Every start step first, so that a workflow that cannot be forked stops the batch before any fork.
  const starts = [];
  for (const id of workflowIds) starts.push([id, await startStep(id, fromStep, fromStepName, fromLastFailure)]);
  const forked = [];
  for (const [id, start] of starts) {
    forked.push((await DBOS.forkWorkflow(id, start, { ...options, newWorkflowID: randomUUID() })).workflowID);
  }
  return { forked_workflow_ids: forked };
});

route('rewind_workflow', unsuccessful, (f) => {
  const b = bodyOf(f);
  return when(`rewinding workflow ${b.workflow_id} to step ${b.start_step ?? 0}`);
}, async (f) => {
  const b = body(f);
  const options = {
    startStep: int(b, 'start_step', OPTIONAL),
    applicationVersion: str(b, 'application_version', OPTIONAL),
    queueName: str(b, 'queue_name', OPTIONAL),
    queuePartitionKey: str(b, 'queue_partition_key', OPTIONAL),
  };
  defined(options);
  await DBOS.rewindWorkflow(str(b, 'workflow_id'), options);
  return { success: true };
});

route('list_application_versions', { output: [] }, when('listing application versions'), async () => ({
  output: (await DBOS.listApplicationVersions()).map((v) => ({
    version_id: v.versionId,
    version_name: v.versionName,
    version_timestamp: Number(v.versionTimestamp),
    created_at: Number(v.createdAt),
  })),
}));

const setLatestContext = (f) => when(`setting latest application version '${f.version_name}'`);

route('set_latest_application_version', unsuccessful, setLatestContext, async (f) => {
  await DBOS.setLatestApplicationVersion(str(f, 'version_name'));
  return { success: true };
});

/** A DBOS WorkflowSchedule as the protocol's ScheduleOutput. */
function scheduleOutput(s, loadContext) {
  return {
    schedule_id: s.scheduleId,
    schedule_name: s.scheduleName,
    workflow_name: s.workflowName,
    workflow_class_name: s.workflowClassName || null,
    schedule: s.schedule,
    status: s.status,
    // None is "null", as 5.2 sends it; not asked for, left out (undefined), as 5.2 leaves it.
    context: loadContext ? inspected(s.context) : undefined,
    last_fired_at: s.lastFiredAt ?? null,
    automatic_backfill: Boolean(s.automaticBackfill),
    cron_timezone: s.cronTimezone ?? null,
    queue_name: s.queueName ?? null,
    application_name: s.applicationName ?? null,
  };
}

route('list_schedules', { output: [] }, when('listing schedules'), async (f) => {
  const b = body(f);
  const filters = {
    status: filter(strOrList(b, 'status', OPTIONAL)),
    workflowName: filter(strOrList(b, 'workflow_name', OPTIONAL)),
    scheduleNamePrefix: filter(strOrList(b, 'schedule_name_prefix', OPTIONAL)),
    applicationName: strOrList(b, 'application_name', OPTIONAL), // [] is every application's, as DBOS reads it
  };
  defined(filters);
  const loadContext = bool(b, 'load_context', true);
  return { output: (await DBOS.listSchedules(filters)).map((s) => scheduleOutput(s, loadContext)) };
});

route('get_schedule', { output: null }, (f) => when(`getting schedule ${f.schedule_name}`), async (f) => {
  const found = await DBOS.getSchedule(str(f, 'schedule_name'));
  return { output: found === null ? null : scheduleOutput(found, bool(f, 'load_context', true)) };
});

route('pause_schedule', unsuccessful, (f) => when(`pausing schedule '${f.schedule_name}'`), async (f) => {
  await DBOS.pauseSchedule(str(f, 'schedule_name'));
  return { success: true };
});

route('resume_schedule', unsuccessful, (f) => when(`resuming schedule '${f.schedule_name}'`), async (f) => {
  await DBOS.resumeSchedule(str(f, 'schedule_name'));
  return { success: true };
});

route('trigger_schedule', { workflow_id: null }, (f) => when(`triggering schedule '${f.schedule_name}'`), async (f) => ({
  workflow_id: (await DBOS.triggerSchedule(str(f, 'schedule_name'))).workflowID,
}));

route('backfill_schedule', { workflow_ids: [] }, (f) => when(`backfilling schedule '${f.schedule_name}'`), async (f) => {
  const start = new Date(str(f, 'start'));
  const end = new Date(str(f, 'end'));
  if (Number.isNaN(start.getTime()) || Number.isNaN(end.getTime())) {
    throw new BadRequest('backfill_schedule: start and end must be ISO 8601 times');
  }
  const handles = await DBOS.backfillSchedule(str(f, 'schedule_name'), start, end);
  return { workflow_ids: handles.map((h) => h.workflowID) };
});

// --- Aggregates and metrics (lib/aggregates.js, from paged public listings) ---

/** A body's fields, checked by kind: { bools: [...], ints: [...], strs: [...], lists: [...], objects: [...] }. */
function fields(b, kinds) {
  const out = {};
  for (const key of kinds.bools ?? []) out[key] = bool(b, key, OPTIONAL);
  for (const key of kinds.ints ?? []) out[key] = int(b, key, OPTIONAL);
  for (const key of kinds.strs ?? []) out[key] = str(b, key, OPTIONAL);
  for (const key of kinds.lists ?? []) out[key] = strList(b, key, OPTIONAL);
  for (const key of kinds.objects ?? []) out[key] = object(b, key, OPTIONAL);
  return out;
}

const WORKFLOW_AGGREGATES = {
  bools: ['group_by_status', 'group_by_name', 'group_by_queue_name', 'group_by_executor_id',
    'group_by_application_version', 'group_by_application_name', 'select_count', 'select_min_created_at',
    'select_max_queue_wait_ms', 'select_max_total_latency_ms', 'was_forked_from', 'has_parent'],
  ints: ['time_bucket_size_ms'],
  strs: ['start_time', 'end_time', 'completed_after', 'completed_before', 'dequeued_after', 'dequeued_before'],
  lists: ['status', 'name', 'app_version', 'executor_id', 'queue_name', 'workflow_id_prefix', 'workflow_ids',
    'forked_from', 'parent_workflow_id', 'user', 'schedule_name', 'application_name'],
  objects: ['attributes'],
};

const STEP_AGGREGATES = {
  bools: ['group_by_function_name', 'group_by_status', 'select_count', 'select_max_duration_ms'],
  ints: ['time_bucket_size_ms'],
  strs: ['completed_after', 'completed_before'],
  lists: ['status', 'function_name', 'workflow_id_prefix', 'application_name'],
};

function appName() {
  return dbosInternal('dbos-executor').DBOSExecutor.globalInstance?.appName;
}

route('get_workflow_aggregates', { output: [] }, when('getting workflow aggregates'), async (f) => ({
  output: await aggregates.workflowAggregates(fields(body(f), WORKFLOW_AGGREGATES), appName()),
}));

route('get_step_aggregates', { output: [] }, when('getting step aggregates'), async (f) => ({
  output: await aggregates.stepAggregates(fields(body(f), STEP_AGGREGATES)),
}));

route('get_metrics', { metrics: [] }, when('getting metrics'), async (f) => {
  const metricClass = str(f, 'metric_class');
  const startTime = str(f, 'start_time');
  const endTime = str(f, 'end_time');
  const applicationName = strList(f, 'application_name', OPTIONAL);
  if (metricClass !== 'workflow_step_count') {
    return { metrics: [], error_message: `Unexpected metric class: ${metricClass}` };
  }
  return { metrics: await aggregates.workflowStepCounts(startTime, endTime, applicationName) };
});

/** A DBOS WorkflowQueue (DBOS.listQueues, DBOS.retrieveQueue: read from its row) as the protocol's QueueOutput. */
function queueOutput(q) {
  const limit = (v) => v ?? null;
  return {
    name: q.name,
    concurrency: limit(q.concurrency),
    worker_concurrency: limit(q.workerConcurrency),
    rate_limit_max: q.rateLimit ? q.rateLimit.limitPerPeriod : null,
    rate_limit_period_sec: q.rateLimit ? q.rateLimit.periodSec : null,
    // Every queue is a priority queue; any per-partition limit makes it a partitioned one.
    priority_enabled: true,
    partition_queue: [q.partitionConcurrency, q.partitionWorkerConcurrency, q.partitionRateLimit].some(
      (v) => v !== undefined && v !== null,
    ),
    polling_interval_sec: (q.minPollingIntervalMs ?? 0) / 1000,
    application_name: q.applicationName ?? null,
    partition_concurrency: limit(q.partitionConcurrency),
    partition_worker_concurrency: limit(q.partitionWorkerConcurrency),
    partition_rate_limit_max: q.partitionRateLimit ? q.partitionRateLimit.limitPerPeriod : null,
    partition_rate_limit_period_sec: q.partitionRateLimit ? q.partitionRateLimit.periodSec : null,
  };
}

route('list_queues', { output: [] }, when('listing queues'), async (f) => {
  // A server predating the filter sends no body; an empty list is every application's queues, as DBOS reads it.
  const b = { type: f.type, ...object(f, 'body', {}) };
  const applicationName = strOrList(b, 'application_name', OPTIONAL);
  return { output: (await DBOS.listQueues(applicationName)).map(queueOutput) };
});

route('get_queue', { output: null }, (f) => when(`getting queue ${f.name}`), async (f) => {
  const queue = await DBOS.retrieveQueue(str(f, 'name'));
  return { output: queue === null ? null : queueOutput(queue) };
});

/** Every type this client answers; any other gets "Unknown message type". */
const SERVED = Object.freeze([...ROUTES.keys()]);

// --- Frames ---

function dumps(reply) {
  return JSON.stringify(reply);
}

/**
 * The frame `text` as a request: { frame } to serve, { reply } already due (an unknown type, a
 * malformed request), or {} when it cannot be addressed (dropped).
 */
function read(textFrame, log) {
  let frame;
  try {
    frame = JSON.parse(textFrame);
  } catch (err) {
    log.warn(`relay client: ignoring a frame from Relay that is not JSON: ${err.message}`);
    return {};
  }
  if (!isObject(frame) || frame === null || !isStr(frame.type) || !isStr(frame.request_id)) {
    log.warn('relay client: ignoring a frame from Relay with no type or request_id');
    return {};
  }
  if (!ROUTES.has(frame.type)) {
    log.warn(`relay client: unexpected message type: ${frame.type.slice(0, 64)}`);
    return { reply: dumps({ type: frame.type, request_id: frame.request_id, error_message: UNKNOWN_TYPE }) };
  }
  return { frame };
}

/** What a failure reply says of the value a handler threw: its message, as 5.2 words it. Where 5.2
 * sends nothing of it, the value itself: 5.2's `${e.message}` is "undefined" for a thrown string or
 * number (and fails on null), and "" for an Error with no message; client-ts sends the string or
 * number, the Error's name ("TypeError"), an object without a message inspected on one line. */
function reasonOf(err) {
  const isObj = err !== null && typeof err === 'object';
  const message = isObj && 'message' in err && err.message !== undefined && err.message !== null ? String(err.message) : '';
  if (message !== '') return message;
  if (err instanceof Error) return err.name || 'Error';
  return isObj ? inspect(err, { breakLength: Infinity }) : String(err);
}

class Handlers {
  /** ctx: { executorId, metadata, log } */
  constructor(ctx) {
    /** Set when the connection stops: a retention round ends at its next batch. */
    this.stopping = false;
    this.ctx = { dbosVersion: dbosVersion(), ...ctx };
    this.ctx.retention = new Retention(ctx.log, () => this.stopping);
  }

  /** The reply's text to the frame `textFrame`, or undefined when it cannot be addressed. */
  async answer(textFrame) {
    const { frame, reply } = read(textFrame, this.ctx.log);
    return frame ? this.respond(frame) : reply;
  }

  /** The reply to a request not served (too busy, stopping): an error and no payload. */
  refuse(textFrame, reason) {
    const { frame, reply } = read(textFrame, this.ctx.log);
    return frame ? dumps({ type: frame.type, request_id: frame.request_id, error_message: reason }) : reply;
  }

  async respond(frame) {
    const handler = ROUTES.get(frame.type);
    const head = { type: frame.type, request_id: frame.request_id };
    try {
      return dumps({ ...head, ...(await handler.handle(frame, this.ctx)) });
    } catch (err) {
      if (err instanceof BadRequest) {
        this.ctx.log.warn(`relay client: malformed request from Relay: ${err.message}`);
        return dumps({ ...head, error_message: err.message });
      }
      // The reply's text as the 5.2 SDK's client words it (its reportException: the context, then the
      // error's message); the log line as the client's own, `relay client:`, with the stack.
      const context = handler.context(frame);
      const reason = reasonOf(err);
      this.ctx.log.error(`relay client: ${context}: ${err && err.stack ? err.stack : reason}`);
      return dumps({ ...head, ...handler.failed, error_message: `${context}: ${reason}` });
    }
  }
}

module.exports = { Handlers, SERVED, UNKNOWN_TYPE, workflowOutput, stepOutput, scheduleOutput };
