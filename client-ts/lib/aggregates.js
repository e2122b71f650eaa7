'use strict';

// Workflow and step aggregates and run counts, computed here from DBOS's public listings: the
// counterpart of the Python client's relay_client/aggregates.py.
//
// The 5.2 SDK answered these with one GROUP BY over its system tables; 5.3 has no such public call.
// The same numbers come from DBOS.listWorkflows (metadata only, in pages) and, for steps,
// DBOS.listWorkflowSteps of each workflow that can hold a step in the range. Both are bounded: past
// MAX_WORKFLOWS workflows (or MAX_STEP_WORKFLOWS for steps) the request fails with an error asking
// for a narrower filter, rather than load the database without end.

const { DBOS } = require('@dbos-inc/dbos-sdk');

const PAGE = 1000;
/** Workflows one aggregate request may read. */
const MAX_WORKFLOWS = 100_000;
/** Workflows whose steps one step aggregate or metrics request may read (a query each). */
const MAX_STEP_WORKFLOWS = 5_000;

class TooManyRows extends Error {}

const iso = (ms) => new Date(ms).toISOString();
const epochMs = (text) => new Date(text).getTime();

/** `input`, its undefined members deleted: an option not given is left out, not given as undefined. */
function defined(input) {
  for (const key of Object.keys(input)) if (input[key] === undefined) delete input[key];
  return input;
}

/** Every workflow matching `filters` (metadata only), oldest first, paged. */
async function workflows(limit, filters) {
  const found = [];
  for (;;) {
    const page = await DBOS.listWorkflows({
      ...filters, limit: PAGE, offset: found.length, loadInput: false, loadOutput: false,
    });
    found.push(...page);
    if (found.length > limit) {
      throw new TooManyRows(`more than ${limit} workflows match: narrow the filter (a time range, say)`);
    }
    if (page.length < PAGE) return found;
  }
}

const groupValue = (value) => (value === undefined || value === null ? null : String(value));
const absent = (v) => v === undefined || v === null;
const bucket = (at, size) => (absent(size) ? [] : [absent(at) ? null : String(Math.floor(at / size) * size)]);
const most = (current, value) => (absent(value) ? current : current === null ? value : Math.max(current, value));

function checkGrouping(groups, size) {
  if (size !== undefined && size !== null && size <= 0) throw new Error('time_bucket_size_ms must be > 0');
  if (!groups.some(Boolean) && (size === undefined || size === null)) {
    throw new Error('At least one group_by flag must be set to True');
  }
}

const WORKFLOW_COLUMNS = [
  ['status', 'group_by_status', (w) => w.status],
  ['name', 'group_by_name', (w) => w.workflowName],
  ['queue_name', 'group_by_queue_name', (w) => w.queueName],
  ['executor_id', 'group_by_executor_id', (w) => w.executorId],
  ['application_version', 'group_by_application_version', (w) => w.applicationVersion],
  ['application_name', 'group_by_application_name', (w) => w.applicationName],
];

/** A get_workflow_aggregates body as DBOS's GetWorkflowsInput. */
function workflowFilters(b, appName) {
  let applicationName = b.application_name ?? undefined;
  // An id-keyed listing is not scoped to this app by default; the SDK's aggregates always were.
  if (applicationName === undefined && b.workflow_ids && b.workflow_ids.length > 0) applicationName = [appName];
  const list = (v) => (Array.isArray(v) && v.length === 0 ? undefined : v ?? undefined);
  return defined({
    status: list(b.status),
    startTime: b.start_time ?? undefined,
    endTime: b.end_time ?? undefined,
    completedAfter: b.completed_after ?? undefined,
    completedBefore: b.completed_before ?? undefined,
    dequeuedAfter: b.dequeued_after ?? undefined,
    dequeuedBefore: b.dequeued_before ?? undefined,
    workflowName: list(b.name),
    applicationVersion: list(b.app_version),
    executorId: list(b.executor_id),
    queueName: list(b.queue_name),
    workflow_id_prefix: list(b.workflow_id_prefix),
    workflowIDs: list(b.workflow_ids),
    forkedFrom: list(b.forked_from),
    parentWorkflowID: list(b.parent_workflow_id),
    authenticatedUser: list(b.user),
    scheduleName: list(b.schedule_name),
    applicationName,
    wasForkedFrom: b.was_forked_from ?? undefined,
    hasParent: b.has_parent ?? undefined,
    attributes: b.attributes ?? undefined,
  });
}

async function workflowAggregates(b, appName) {
  const size = b.time_bucket_size_ms ?? null;
  checkGrouping(WORKFLOW_COLUMNS.map(([, flag]) => b[flag]), size);
  const columns = WORKFLOW_COLUMNS.filter(([, flag]) => b[flag]);
  const names = [...columns.map(([name]) => name), ...(size !== null ? ['time_bucket'] : [])];
  const groups = new Map();
  for (const w of await workflows(MAX_WORKFLOWS, workflowFilters(b, appName))) {
    const key = [...columns.map(([, , get]) => groupValue(get(w))), ...bucket(w.createdAt, size)];
    const id = JSON.stringify(key);
    if (!groups.has(id)) {
      groups.set(id, { key, count: 0, minCreatedAt: null, maxQueueWaitMs: null, maxTotalLatencyMs: null });
    }
    const g = groups.get(id);
    g.count += 1;
    if (!absent(w.createdAt)) {
      g.minCreatedAt = g.minCreatedAt === null ? w.createdAt : Math.min(g.minCreatedAt, w.createdAt);
      if (!absent(w.dequeuedAt)) g.maxQueueWaitMs = most(g.maxQueueWaitMs, w.dequeuedAt - w.createdAt);
      if (!absent(w.completedAt)) g.maxTotalLatencyMs = most(g.maxTotalLatencyMs, w.completedAt - w.createdAt);
    }
  }
  // With nothing selected the SDK counts.
  const selected = b.select_min_created_at || b.select_max_queue_wait_ms || b.select_max_total_latency_ms;
  const count = b.select_count || !selected;
  return [...groups.values()].map((g) => ({
    group: Object.fromEntries(names.map((name, i) => [name, g.key[i]])),
    count: count ? g.count : null,
    min_created_at: b.select_min_created_at ? g.minCreatedAt : null,
    max_queue_wait_ms: b.select_max_queue_wait_ms ? g.maxQueueWaitMs : null,
    max_total_latency_ms: b.select_max_total_latency_ms ? g.maxTotalLatencyMs : null,
  }));
}

/**
 * The workflows that can hold a step completed at or after `completedAfter`: those finished since,
 * those running (PENDING), and those waiting (ENQUEUED, DELAYED) that changed since. In-flight
 * first: a workflow that finishes between the listings is then in the second.
 */
async function windowCandidates(completedAfter, common) {
  const running = await workflows(MAX_STEP_WORKFLOWS, { ...common, status: ['PENDING'] });
  const waiting = (await workflows(MAX_WORKFLOWS, { ...common, status: ['ENQUEUED', 'DELAYED'] })).filter(
    (w) => w.updatedAt === undefined || w.updatedAt === null || w.updatedAt + 1000 > completedAfter,
  );
  const finished = await workflows(MAX_STEP_WORKFLOWS, { ...common, completedAfter: iso(completedAfter) });
  const candidates = [...new Map([...running, ...waiting, ...finished].map((w) => [w.workflowID, w])).values()];
  if (candidates.length > MAX_STEP_WORKFLOWS) {
    throw new TooManyRows(`more than ${MAX_STEP_WORKFLOWS} workflows match: narrow the filter (a time range, say)`);
  }
  return candidates;
}

/** Every step that completed in the range (bounds inclusive), of workflows that can hold one. A step
 * completes after its workflow starts and before it finishes. */
async function steps({ completedAfter, completedBefore, workflowIdPrefix, applicationName }) {
  const common = defined({ workflow_id_prefix: workflowIdPrefix, applicationName });
  if (completedBefore !== null) common.endTime = iso(completedBefore);
  const candidates = completedAfter === null
    ? await workflows(MAX_STEP_WORKFLOWS, common)
    : await windowCandidates(completedAfter, common);
  const found = [];
  for (const w of candidates) {
    for (const step of (await DBOS.listWorkflowSteps(w.workflowID)) ?? []) {
      const at = step.completedAtEpochMs ?? null;
      if (completedAfter !== null && (at === null || at < completedAfter)) continue;
      if (completedBefore !== null && (at === null || at > completedBefore)) continue;
      found.push(step);
    }
  }
  return found;
}

async function stepAggregates(b) {
  const size = b.time_bucket_size_ms ?? null;
  checkGrouping([b.group_by_function_name, b.group_by_status], size);
  const names = [
    ...(b.group_by_function_name ? ['function_name'] : []),
    ...(b.group_by_status ? ['status'] : []),
    ...(size !== null ? ['time_bucket'] : []),
  ];
  const list = (v) => (Array.isArray(v) && v.length === 0 ? undefined : v ?? undefined);
  const counts = new Map();
  const found = await steps({
    completedAfter: b.completed_after ? epochMs(b.completed_after) : null,
    completedBefore: b.completed_before ? epochMs(b.completed_before) : null,
    workflowIdPrefix: list(b.workflow_id_prefix),
    applicationName: b.application_name ?? undefined,
  });
  for (const step of found) {
    // Steps have no status of their own: an error makes one ERROR.
    const status = step.error === undefined || step.error === null ? 'SUCCESS' : 'ERROR';
    if (b.status && b.status.length > 0 && !b.status.includes(status)) continue;
    if (b.function_name && b.function_name.length > 0 && !b.function_name.includes(step.name)) continue;
    const key = [
      ...(b.group_by_function_name ? [step.name] : []),
      ...(b.group_by_status ? [status] : []),
      ...bucket(step.completedAtEpochMs, size),
    ];
    const started = step.startedAtEpochMs ?? null;
    const completed = step.completedAtEpochMs ?? null;
    const id = JSON.stringify(key);
    if (!counts.has(id)) counts.set(id, { key, count: 0, maxDurationMs: null });
    const entry = counts.get(id);
    entry.count += 1;
    const duration = started !== null && completed !== null ? completed - started : null;
    entry.maxDurationMs = most(entry.maxDurationMs, duration);
  }
  const count = b.select_count || !b.select_max_duration_ms;
  return [...counts.values()].map((e) => ({
    group: Object.fromEntries(names.map((name, i) => [name, e.key[i]])),
    count: count ? e.count : null,
    max_duration_ms: b.select_max_duration_ms ? e.maxDurationMs : null,
  }));
}

/** Workflows created and steps completed in [start, end), by name: the workflow_step_count class. */
async function workflowStepCounts(startTime, endTime, applicationName) {
  const start = epochMs(startTime);
  const end = epochMs(endTime);
  if (Number.isNaN(start) || Number.isNaN(end)) throw new Error('start_time and end_time must be ISO 8601 times');
  const byName = new Map();
  for (const w of await workflows(MAX_WORKFLOWS, defined({ startTime, endTime, applicationName }))) {
    if (w.createdAt !== undefined && w.createdAt !== null && start <= w.createdAt && w.createdAt < end) {
      byName.set(w.workflowName, (byName.get(w.workflowName) ?? 0) + 1);
    }
  }
  const stepsByName = new Map();
  const inRange = await steps({ completedAfter: start, completedBefore: end - 1, applicationName });
  for (const step of inRange) {
    stepsByName.set(step.name, (stepsByName.get(step.name) ?? 0) + 1);
  }
  return [
    ...[...byName].map(([name, value]) => ({ metric_type: 'workflow_count', metric_name: name, value })),
    ...[...stepsByName].map(([name, value]) => ({ metric_type: 'step_count', metric_name: name, value })),
  ];
}

module.exports = {
  workflowAggregates, stepAggregates, workflowStepCounts, TooManyRows, MAX_WORKFLOWS, MAX_STEP_WORKFLOWS, defined,
};
