'use strict';

// Executor ids drawn by newExecutorId(), and which connection holds each.
//
// Relay recovers a dead executor's workflows by its id, so an id must name one process's launch and
// nothing else: 'local' (every DBOS process without an id) or an id typed into a config file would
// make a peer take the work of live processes. Only ids drawn here, in this process, are accepted by
// connect(), and one connection at a time holds each.

const { randomUUID } = require('node:crypto');
const { ConnectRefused } = require('./errors');

const HOW = 'Configure DBOS with DBOS.setConfig({ ..., executorID: relay.newExecutorId() }) before DBOS.launch().';

const issued = new Set();
const held = new Set();
// id -> a WeakRef to the DBOS launch (DBOSExecutor.globalInstance) that first connected with it.
const owners = new Map();

/** A fresh executor id for DBOSConfig.executorID: a random UUID, one per launch. */
function newExecutorId() {
  const id = randomUUID();
  issued.add(id);
  return id;
}

/** Take `executorId` for one connection of the DBOS launch `launch`, or throw ConnectRefused saying why. */
function claim(executorId, launch) {
  if (typeof executorId !== 'string' || executorId === '') {
    throw new ConnectRefused(`DBOS's executor id is ${JSON.stringify(executorId)}: ${HOW}`);
  }
  if (executorId === 'local') {
    throw new ConnectRefused(
      "DBOS's executor id is 'local', which every DBOS process without an id shares: recovering it " +
        `would take other processes' workflows. ${HOW}`,
    );
  }
  if (!issued.has(executorId)) {
    throw new ConnectRefused(`executor id ${JSON.stringify(executorId)} was not issued by newExecutorId(). ${HOW}`);
  }
  if (held.has(executorId)) {
    throw new ConnectRefused(
      `executor id ${JSON.stringify(executorId)} is already connected to Relay: stop that connection first`,
    );
  }
  const owner = owners.get(executorId)?.deref();
  if (owner !== undefined && owner !== launch) {
    throw new ConnectRefused(
      `executor id ${JSON.stringify(executorId)} belongs to an earlier DBOS launch; draw a new one with ` +
        'newExecutorId() for each launch',
    );
  }
  owners.set(executorId, new WeakRef(launch));
  held.add(executorId);
  return executorId;
}

function release(executorId) {
  held.delete(executorId);
}

module.exports = { newExecutorId, claim, release };
