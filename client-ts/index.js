'use strict';

// @relay-oss/client: an open executor client for Relay, for applications on DBOS's TypeScript SDK
// 5.3, whose own conductor client moved to the proprietary @dbos-inc/dbos-enterprise package.
//
//     const relay = require('@relay-oss/client');
//     DBOS.setConfig({ ..., executorID: relay.newExecutorId() });
//     await DBOS.launch();                                  // no conductorKey
//     const conn = relay.connect('ws://relay:8080/', { key: '...', app: 'ledger' });
//     ...
//     await conn.stop();                                    // before DBOS.shutdown()
//
// It never imports, loads, imitates or answers for @dbos-inc/dbos-enterprise: DBOS is launched
// without a conductor key, so DBOS never loads it either.

const { DBOS } = require('@dbos-inc/dbos-sdk');
const { Connection } = require('./lib/connection');
const { Handlers, SERVED } = require('./lib/handlers');
const { newExecutorId, claim, release } = require('./lib/ids');
const { ConnectRefused, RelayClientError } = require('./lib/errors');

const MAX_METADATA_BYTES = 64 * 1024;
// The options connect() takes (ConnectOptions in index.d.ts): any other name is refused, so a typo
// (`maxFrameByte`, `CA`) is not silently ignored, nor can an option reach the connection's internals.
const OPTIONS = Object.freeze([
  'key',
  'app',
  'metadata',
  'ca',
  'logger',
  'maxConcurrentRequests',
  'maxWaitingRequests',
  'sendQueueSize',
  'maxFrameBytes',
]);

function checkOptions(options) {
  if (options === null || typeof options !== 'object' || Array.isArray(options)) {
    const given = options === null ? 'null' : typeof options;
    throw new TypeError(`the options must be an object ({ key, app, ... }), not ${given}`);
  }
  const unknown = Object.keys(options).filter((name) => !OPTIONS.includes(name));
  if (unknown.length > 0) {
    const names = unknown.map((name) => JSON.stringify(name.slice(0, 64))).join(', ');
    const plural = unknown.length > 1 ? 's' : '';
    throw new TypeError(`unknown option${plural} ${names}: connect() takes ${OPTIONS.join(', ')}`);
  }
}

function checkMetadata(metadata) {
  if (metadata === undefined || metadata === null) return undefined;
  let encoded;
  try {
    encoded = JSON.stringify(metadata);
  } catch (err) {
    throw new TypeError(`metadata must be JSON-serializable: ${err.message}`);
  }
  if (typeof metadata !== 'object' || Array.isArray(metadata)) throw new TypeError('metadata must be an object');
  if (Buffer.byteLength(encoded) > MAX_METADATA_BYTES) throw new RangeError('metadata is more than 64 KiB as JSON');
  return JSON.parse(encoded);
}

function dbosLaunch() {
  return require('@dbos-inc/dbos-sdk/internal/dbos-executor').DBOSExecutor.globalInstance;
}

/**
 * Connect this DBOS executor to Relay at `url` (ws:// or wss://): returns a Connection at once,
 * which connects, answers Relay and reconnects after a loss until stop() or DBOS's shutdown.
 */
function connect(url, options = {}) {
  checkOptions(options);
  const { key, metadata, ca, logger } = options;
  const { maxConcurrentRequests, maxWaitingRequests, sendQueueSize, maxFrameBytes } = options;
  if (!DBOS.isInitialized()) throw new ConnectRefused('DBOS is not launched: call connect() after DBOS.launch()');
  const launch = dbosLaunch();
  const dbosApp = launch?.appName;
  const app = options.app ?? dbosApp;
  if (typeof app !== 'string' || app === '') throw new TypeError('app must be a non-empty string');
  if (dbosApp !== undefined && app !== dbosApp) {
    throw new ConnectRefused(
      `app ${JSON.stringify(app)} is not DBOS's application name ${JSON.stringify(dbosApp)}: an executor of ` +
        'another application would answer recoveries by finding nothing to recover',
    );
  }
  if (launch?.conductor) {
    throw new ConnectRefused('DBOS was launched with a conductor key: launch it without one to use this client');
  }
  const log = logger ?? DBOS.logger;
  const executorId = DBOS.executorID;
  const checkedMetadata = checkMetadata(metadata);
  const handlers = new Handlers({ executorId, metadata: checkedMetadata, log });
  // Checks the URL, key and options before the id is claimed: a refusal leaves nothing held.
  const connection = new Connection(url, {
    key,
    app,
    handlers,
    log,
    ca,
    maxConcurrentRequests, // undefined: the connection's default
    maxWaitingRequests,
    sendQueueSize,
    maxFrameBytes,
    alive: () => DBOS.isInitialized() && dbosLaunch() === launch,
  });
  claim(executorId, launch);
  connection._onStop.push(() => release(executorId));
  connection.start();
  return connection;
}

module.exports = { connect, newExecutorId, ConnectRefused, RelayClientError, SERVED };
