'use strict';

// `retention`: garbage collection and a global timeout by cut-offs, in the background; the
// counterpart of the Python client's relay_client/retention.py, on DBOS's public API.
//
// As the SDK's own clients did, the request is answered success: true at once and the round runs on
// its own; a request that arrives while a round is still running is skipped (a warning), and what
// goes wrong is only logged.
//
// Built on public listings (DBOS.listWorkflows) and DBOS.deleteWorkflows / DBOS.cancelWorkflows: the
// collection deletes terminal workflows (of every application, as the SDK's own round did) whose
// completedAt is before the cut-off, gc_batch_size at a time; with gc_rows_threshold the cut-off
// moves up to the completion time of the threshold-th newest completed workflow, whichever deletes
// more. The timeout cancels this application's PENDING, ENQUEUED and DELAYED workflows created at
// or before its cut-off. There is no database-wide lock across executors: Relay sends a round to one
// executor, and deleting or cancelling twice is harmless.

const { DBOS } = require('@dbos-inc/dbos-sdk');

const DEFAULT_GC_BATCH_SIZE = 50_000;
const IN_FLIGHT = ['PENDING', 'ENQUEUED', 'DELAYED'];
// Listed a page at a time: the batch may be large.
const PAGE = 1000;
// Every application's workflows: an empty list is no application filter (DBOS's default is this one's).
const EVERY_APP = [];

const iso = (ms) => new Date(ms).toISOString();

/** A binary min-heap of numbers (Python's heapq, as the Python client keeps them): each step is
 * O(log n), where sorting the array again at each row made a round over many rows quadratic, the
 * event loop held for seconds at a page. */
class MinHeap {
  constructor() {
    this.items = [];
  }

  get size() {
    return this.items.length;
  }

  get least() {
    return this.items[0];
  }

  push(value) {
    const items = this.items;
    items.push(value);
    for (let i = items.length - 1; i > 0; ) {
      const parent = (i - 1) >> 1;
      if (items[parent] <= items[i]) break;
      [items[parent], items[i]] = [items[i], items[parent]];
      i = parent;
    }
  }

  replaceLeast(value) {
    const items = this.items;
    items[0] = value;
    for (let i = 0; ; ) {
      const left = 2 * i + 1;
      const right = left + 1;
      let least = i;
      if (left < items.length && items[left] < items[least]) least = left;
      if (right < items.length && items[right] < items[least]) least = right;
      if (least === i) break;
      [items[least], items[i]] = [items[i], items[least]];
      i = least;
    }
  }
}

/** The completion time below which terminal workflows go (undefined: collect nothing). */
async function gcCutoff(cutoffMs, rowsThreshold) {
  let cutoff = cutoffMs ?? undefined;
  if (rowsThreshold !== undefined && rowsThreshold !== null && rowsThreshold > 0) {
    const newest = new MinHeap(); // the rowsThreshold newest completion times
    for (let offset = 0; ; ) {
      const page = await DBOS.listWorkflows({
        completedAfter: iso(0), applicationName: EVERY_APP, limit: PAGE, offset, loadInput: false, loadOutput: false,
      });
      offset += page.length;
      for (const w of page) {
        if (w.completedAt === undefined || w.completedAt === null) continue;
        const at = Number(w.completedAt);
        if (newest.size < rowsThreshold) newest.push(at);
        else if (at > newest.least) newest.replaceLeast(at);
      }
      if (page.length < PAGE) break;
    }
    if (newest.size === rowsThreshold && (cutoff === undefined || newest.least > cutoff)) cutoff = newest.least;
  }
  return cutoff;
}

/** Delete terminal workflows completed before the cut-off, a batch at a time; how many. */
async function collect(body, stopping = () => false) {
  const cutoff = await gcCutoff(body.gc_cutoff_epoch_ms, body.gc_rows_threshold);
  if (cutoff === undefined) return 0;
  const batch = body.gc_batch_size || DEFAULT_GC_BATCH_SIZE;
  let deleted = 0;
  while (!stopping()) {
    const ids = [];
    while (ids.length < batch) {
      // completedBefore is inclusive, the cut-off is not.
      const want = Math.min(PAGE, batch - ids.length);
      const page = await DBOS.listWorkflows({
        completedBefore: iso(cutoff - 1), applicationName: EVERY_APP, limit: want, offset: ids.length,
        loadInput: false, loadOutput: false,
      });
      ids.push(...page.map((w) => w.workflowID));
      if (page.length < want) break;
    }
    if (ids.length > 0) {
      await DBOS.deleteWorkflows(ids);
      deleted += ids.length;
    }
    if (ids.length < batch) break;
  }
  return deleted;
}

/** Cancel this application's in-flight workflows created at or before the cut-off; how many. */
async function timeOut(cutoffMs) {
  const found = await DBOS.listWorkflows({
    status: IN_FLIGHT, endTime: iso(cutoffMs), loadInput: false, loadOutput: false,
  });
  const ids = found.map((w) => w.workflowID);
  if (ids.length > 0) await DBOS.cancelWorkflows(ids);
  return ids.length;
}

/** Runs one round at a time; `stopping` ends a round between batches. */
class Retention {
  constructor(log, stopping = () => false) {
    this.log = log;
    this.stopping = stopping;
    this.round = null;
  }

  /** Start a round; false (and nothing started) if the previous one is still running. */
  start(body) {
    if (this.round !== null) {
      this.log.warn('relay client: Skipping retention: the previous round on this executor is still running.');
      return false;
    }
    this.round = this._run(body).finally(() => {
      this.round = null;
    });
    return true;
  }

  /** Resolves once the round running (if any) has ended, or after `ms`. */
  async join(ms) {
    if (this.round === null) return;
    let timer;
    await Promise.race([this.round, new Promise((resolve) => (timer = setTimeout(resolve, ms)))]);
    clearTimeout(timer);
  }

  async _run(body) {
    try {
      await collect(body, this.stopping);
      if (body.timeout_cutoff_epoch_ms !== undefined && body.timeout_cutoff_epoch_ms !== null && !this.stopping()) {
        await timeOut(body.timeout_cutoff_epoch_ms);
      }
    } catch (err) {
      if (this.stopping()) {
        // Shutdown took DBOS away in the middle of a batch; the next round does the rest.
        this.log.debug?.('relay client: retention interrupted by shutdown');
        return;
      }
      const shown = err && err.stack ? err.stack : err;
      this.log.error(`relay client: Exception encountered during enforcing retention policy: ${shown}`);
    }
  }
}

module.exports = { Retention, collect, timeOut, gcCutoff, MinHeap, DEFAULT_GC_BATCH_SIZE };
