// Typings of @relay-oss/client (index.js): Relay's open executor client for DBOS's TypeScript SDK 5.3.

/** A logger as DBOS's (DBOS.logger): the client logs through it unless given another. */
export interface RelayClientLogger {
  debug(message: string): void;
  info(message: string): void;
  warn(message: string): void;
  error(message: string): void;
}

export interface ConnectOptions {
  /** The conductor key Relay issued for the app (required, not empty). */
  key: string;
  /** The Relay app the executor joins: DBOS's application name (its config's `name`), the default. */
  app?: string;
  /** The executor metadata Relay shows: a JSON object of at most 64 KiB. */
  metadata?: Record<string, unknown>;
  /** CA certificates (PEM) to trust for a wss:// URL instead of Node's own; refused for ws://. */
  ca?: string | Uint8Array | Array<string | Uint8Array>;
  /** Where the client logs (default: DBOS.logger). */
  logger?: RelayClientLogger;
  /** Requests served at once (default 4). */
  maxConcurrentRequests?: number;
  /** Requests waiting for a turn beyond those; more are answered "busy" at once (default 64). */
  maxWaitingRequests?: number;
  /** Replies queued for sending before a handler waits (default 64). */
  sendQueueSize?: number;
  /** The largest frame taken from Relay, in bytes (default 100 MiB, ws's); a larger one closes the socket (1009),
   * and the client connects again. */
  maxFrameBytes?: number;
}

export interface Connection {
  /** DBOS's executor id, drawn by newExecutorId(). */
  readonly executorId: string;
  readonly app: string;
  /** Whether a socket to Relay is open now. */
  readonly connected: boolean;
  /** False once stop() was called (or DBOS was shut down). */
  readonly running: boolean;
  /** Resolves once the connection has stopped. */
  readonly stopped: Promise<void>;
  /** Let the requests taken answer (up to 2 s; new ones are refused) and a retention round end (up to 10 s), then
   * close the socket (code 1000) and stop reconnecting; resolves once it is closed. Call it before DBOS.shutdown(). */
  stop(): Promise<void>;
}

/** A fresh executor id for DBOSConfig.executorID: a random UUID, one per launch. */
export function newExecutorId(): string;

/**
 * Connect this process's DBOS (launched, without a conductor key) to Relay at `url`
 * (`ws://host:port/` or `wss://...`). Returns at once; the connection connects, answers Relay and
 * reconnects after a loss until stop() or DBOS's shutdown.
 * @throws ConnectRefused when DBOS is not launched, was launched with a conductor key, its executor
 *   id is `local` or was not drawn by newExecutorId() (or is held by a running connection, or an
 *   earlier launch), or `app` is not DBOS's application name.
 * @throws TypeError or RangeError for a URL, key or option no Relay could take (never naming the key).
 */
export function connect(url: string, options: ConnectOptions): Connection;

export class RelayClientError extends Error {}
export class ConnectRefused extends RelayClientError {}

/** The message types the client serves; any other is answered "Unknown message type". */
export const SERVED: readonly string[];
