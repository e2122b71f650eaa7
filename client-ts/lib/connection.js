'use strict';

// The socket to Relay: connects, answers, and reconnects until stopped.
//
// - Relay speaks first (executor_info); the client only answers. The handshake's executor_info is
//   answered at once, outside the turns, so requests still running never keep the executor from
//   joining again.
// - At most maxConcurrentRequests requests are served at once; up to maxWaitingRequests more wait
//   for a turn, and a request beyond those is answered at once with an error saying the client is
//   busy (memory stays bounded, and Relay hears why instead of waiting out its timeout).
// - Replies go through a bounded send queue (sendQueueSize) to one sender that waits for each
//   frame to be written: a handler whose reply finds the queue full waits, so a Relay slow to read
//   holds handlers back rather than memory growing; and while a refusal (busy, stopping) waits so,
//   the socket is not read (the requests of a flood stay in the sockets' buffers). Replies to
//   requests of a socket that has closed are dropped: they were asked on a socket that is gone.
// - Busy refusals are warned of once, then counted (debug), and the count logged when the client
//   takes a request again.
// - Relay's pings are answered (ws does it); the client pings Relay every 20 s and gives up on the
//   socket when no pong comes within 15 s, as the SDK's client does.
// - After a loss it reconnects about a second later (0.5 to 1.5 s, jittered, so executors cut off
//   together do not all come back at once), forever until stopped. A refusal that will repeat (HTTP
//   4xx other than 429; close codes 4400, 4401, 4403, 4409; an untrusted certificate; a failed TLS
//   handshake: a wss:// URL at a port without TLS) waits twice as long each time in a row, up to
//   30 s; Relay too busy (429, 5xx; close codes 4408, 4410) up to 2 s; each times the jitter. A
//   socket open 10 s or more starts the count over.
// - stop() first lets the requests already taken answer: from then on a new request is refused at
//   once (an error and no payload, which Relay reads as a refusal and asks another executor), and
//   it waits up to 2 s (DRAIN_REQUESTS_MS) for the requests in progress or waiting for a turn to be
//   answered and their replies sent, then up to 10 s (DRAIN_RETENTION_MS) for a retention round,
//   which ends at its next batch; then it closes the socket (code 1000) and stops reconnecting.
// - The key is part of the URL; nothing the client logs carries it (the URL is shown with ***), nor
//   what console.log, util.inspect or JSON.stringify show of a Connection.

const { inspect } = require('node:util');
const WebSocket = require('ws');

const PING_INTERVAL_MS = 20_000;
const PING_TIMEOUT_MS = 15_000;
const OPEN_TIMEOUT_MS = 5_000;
const CLOSE_TIMEOUT_MS = 5_000;
// ws's own default for maxPayload, which passing maxPayload: undefined would turn into no limit at all.
const MAX_FRAME_BYTES = 100 * 1024 * 1024;
const DRAIN_REQUESTS_MS = 2_000;
const DRAIN_RETENTION_MS = 10_000;
const STOPPING = 'relay client: stopping; not served, ask another executor';
const WATCH_INTERVAL_MS = 500;
const RECONNECT_MS = 1_000;
const REFUSED_MAX_MS = 30_000;
const BUSY_MAX_MS = 2_000;
const STEADY_MS = 10_000;
const REDACT_ANYWHERE_MIN = 8;
const REFUSED_CLOSE_CODES = new Set([4400, 4401, 4403, 4409]);
const BUSY_CLOSE_CODES = new Set([4408, 4410]);

const Retry = Object.freeze({ SOON: 'soon', BUSY: 'busy', REFUSED: 'refused' });

/** The wait before the next try, in ms (see the module's comment). */
function reconnectDelay(retry = Retry.SOON, inARow = 0, random = Math.random) {
  const jitter = 0.5 + random();
  if (retry === Retry.SOON || inARow <= 0) return jitter * RECONNECT_MS;
  const most = retry === Retry.REFUSED ? REFUSED_MAX_MS : BUSY_MAX_MS;
  return jitter * Math.min(most, RECONNECT_MS * 2 ** Math.min(inARow - 1, 30));
}

function retryAfterStatus(status) {
  return status === 429 || status >= 500 ? Retry.BUSY : Retry.REFUSED;
}

function retryAfterClose(code) {
  if (REFUSED_CLOSE_CODES.has(code)) return Retry.REFUSED;
  return BUSY_CLOSE_CODES.has(code) ? Retry.BUSY : Retry.SOON;
}

// The codes of Node's TLS errors for a certificate it does not trust (OpenSSL's X509 verify results, and
// Node's own check of the name): the same certificate, the same refusal next time.
const CERTIFICATE_CODES = new Set([
  'UNABLE_TO_GET_ISSUER_CERT', 'UNABLE_TO_GET_CRL', 'UNABLE_TO_DECRYPT_CERT_SIGNATURE',
  'UNABLE_TO_DECRYPT_CRL_SIGNATURE', 'UNABLE_TO_DECODE_ISSUER_PUBLIC_KEY', 'CERT_SIGNATURE_FAILURE',
  'CRL_SIGNATURE_FAILURE', 'CERT_NOT_YET_VALID', 'CERT_HAS_EXPIRED', 'CRL_NOT_YET_VALID', 'CRL_HAS_EXPIRED',
  'ERROR_IN_CERT_NOT_BEFORE_FIELD', 'ERROR_IN_CERT_NOT_AFTER_FIELD', 'ERROR_IN_CRL_LAST_UPDATE_FIELD',
  'ERROR_IN_CRL_NEXT_UPDATE_FIELD', 'DEPTH_ZERO_SELF_SIGNED_CERT', 'SELF_SIGNED_CERT_IN_CHAIN',
  'UNABLE_TO_GET_ISSUER_CERT_LOCALLY', 'UNABLE_TO_VERIFY_LEAF_SIGNATURE', 'CERT_CHAIN_TOO_LONG', 'CERT_REVOKED',
  'INVALID_CA', 'PATH_LENGTH_EXCEEDED', 'INVALID_PURPOSE', 'CERT_UNTRUSTED', 'CERT_REJECTED', 'HOSTNAME_MISMATCH',
  'ERR_TLS_CERT_ALTNAME_INVALID',
]);

/** What a socket's error before it opened says of TLS: 'certificate' (not trusted), 'handshake' (the TLS
 * handshake failed: a port that speaks no TLS, no protocol or cipher in common; OpenSSL's EPROTO or
 * ERR_SSL_*), or null (no TLS failure: a loss, such as a handshake cut off, ECONNRESET). */
function tlsFailure(err) {
  const code = err && err.code;
  if (typeof code !== 'string') return null;
  if (CERTIFICATE_CODES.has(code)) return 'certificate';
  if (code.startsWith('ERR_SSL_')) return 'handshake';
  if (code === 'EPROTO' && /SSL routines/.test(String(err.message))) return 'handshake';
  return null;
}

/** OpenSSL's reason in a TLS error ("wrong version number"), else its message: the same text each time. */
function opensslReason(err) {
  if (err.reason) return String(err.reason);
  const found = /SSL routines:[^:]*:([^:]+)/.exec(String(err.message));
  return found ? found[1] : String(err.message);
}

/** Throws unless `base` is a URL the client can connect to; the message names only the part at fault. */
function checkUrl(base) {
  if (typeof base !== 'string') throw new TypeError(`the URL must be a string, not ${typeof base}`);
  let parts;
  try {
    parts = new URL(base);
  } catch {
    throw new TypeError("not a URL Relay can be reached at (Relay's executor URL: ws://host:port/)");
  }
  if (parts.protocol !== 'ws:' && parts.protocol !== 'wss:') {
    throw new TypeError(`the URL must start with ws:// or wss:// (Relay's executor URL), not ${parts.protocol}//`);
  }
  if (!parts.hostname) throw new TypeError('the URL has no host');
  if (parts.port === '0') throw new TypeError('port 0 is not a port to connect to');
  if (parts.search || parts.hash) {
    throw new TypeError('the URL must not have a query or a fragment: the client adds websocket/{app}/{key} to it');
  }
  return parts;
}

function checkKey(key) {
  if (typeof key !== 'string') throw new TypeError(`the key must be a string, not ${typeof key}`);
  if (!key) throw new TypeError("the key is empty: give the conductor key Relay issued for this app");
}

function websocketUrl(base, app, key) {
  return `${base.replace(/\/+$/, '')}/websocket/${encodeURIComponent(app)}/${encodeURIComponent(key)}`;
}

/** A counting semaphore for the request turns. */
class Turns {
  constructor(size) {
    this.free = size;
    this.waiting = [];
  }

  async take() {
    if (this.free > 0) {
      this.free -= 1;
      return;
    }
    await new Promise((resolve) => this.waiting.push(resolve));
  }

  give() {
    const next = this.waiting.shift();
    if (next) next();
    else this.free += 1;
  }
}

/** One socket's bounded outbox and its sender. */
class Outbox {
  constructor(ws, size) {
    this.ws = ws;
    this.size = size;
    this.frames = [];
    this.roomWaiters = [];
    this.sending = false;
    this.closed = false;
    this.refusalsWaiting = 0; // refusals waiting for room: reading the socket is paused meanwhile
  }

  /** Whether a frame put now waits for room. */
  get full() {
    return !this.closed && this.frames.length >= this.size;
  }

  /** Queue `text`; waits while the queue is full. Dropped once the socket is gone. */
  async put(text) {
    while (!this.closed && this.frames.length >= this.size) {
      await new Promise((resolve) => this.roomWaiters.push(resolve));
    }
    if (this.closed) return;
    this.frames.push(text);
    this.pump();
  }

  pump() {
    if (this.sending || this.closed || this.frames.length === 0) return;
    this.sending = true;
    const text = this.frames.shift();
    this.roomWaiters.shift()?.();
    this.ws.send(text, (err) => {
      this.sending = false;
      if (err) {
        this.close();
        return;
      }
      this.pump();
    });
  }

  /** Resolves once every frame queued has been written (or the socket is gone). */
  async flushed() {
    while (!this.closed && (this.sending || this.frames.length > 0)) {
      await new Promise((resolve) => setTimeout(resolve, 10));
    }
  }

  close() {
    this.closed = true;
    this.frames = [];
    for (const wake of this.roomWaiters.splice(0)) wake();
  }
}

class Connection {
  constructor(baseUrl, { key, app, handlers, log, ca, maxConcurrentRequests = 4, maxWaitingRequests = 64,
    sendQueueSize = 64, maxFrameBytes = MAX_FRAME_BYTES, alive = () => true }) {
    const parts = checkUrl(baseUrl);
    checkKey(key);
    if (!(maxConcurrentRequests >= 1) || !(sendQueueSize >= 1) || !(maxWaitingRequests >= 0)) {
      throw new RangeError('maxConcurrentRequests and sendQueueSize must be at least 1, maxWaitingRequests at least 0');
    }
    if (!Number.isSafeInteger(maxFrameBytes) || maxFrameBytes < 1) {
      throw new RangeError('maxFrameBytes must be a whole number of bytes, at least 1');
    }
    if (ca !== undefined && parts.protocol !== 'wss:') throw new TypeError('ca is for a wss:// URL only');
    this.app = app;
    this.executorId = handlers.ctx.executorId;
    this.handlers = handlers;
    this.log = log;
    this._url = websocketUrl(baseUrl, app, key);
    this.shownUrl = `${websocketUrl(baseUrl, app, '')}***`;
    this._key = key;
    this._ca = ca;
    this._maxConcurrent = maxConcurrentRequests;
    this._maxHeld = maxConcurrentRequests + maxWaitingRequests;
    this._sendQueueSize = sendQueueSize;
    this._maxFrameBytes = maxFrameBytes;
    this._alive = alive;
    this._turns = new Turns(maxConcurrentRequests);
    this._held = 0;
    this._refusedBusy = 0; // since the client could last take a request: warned once, then counted
    this._idleWaiters = [];
    this._outbox = null;
    this._stopping = false;
    this._ws = null;
    this._timer = null;
    this._watch = null;
    this._lastProblem = '';
    this._last = Retry.SOON;
    this._inARow = 0;
    this.connected = false;
    this.stopped = new Promise((resolve) => {
      this._markStopped = resolve;
    });
    this._onStop = [];
  }

  start() {
    this._watch = setInterval(() => {
      if (!this._alive()) {
        this.log.info('relay client: DBOS was shut down; disconnecting from Relay');
        this.stop();
      }
    }, WATCH_INTERVAL_MS);
    this._watch.unref();
    this._open();
  }

  get running() {
    return !this._stopping;
  }

  /** What JSON.stringify shows of the connection: never the key (in the URL it holds, and its socket's). */
  toJSON() {
    const { app, executorId, shownUrl: url, connected, running } = this;
    return { app, executorId, url, connected, running };
  }

  /** What console.log and util.inspect show: the same. */
  [inspect.custom](depth, options, show) {
    return `Connection ${show(this.toJSON(), options)}`;
  }

  /** Let the requests taken answer (bounded; new ones are refused), end a retention round, then close
   * the socket (a close frame, code 1000) and stop reconnecting; resolves once it is closed. */
  async stop() {
    if (!this._stopping) {
      this._stopping = true;
      this.handlers.stopping = true;
      clearInterval(this._watch);
      clearTimeout(this._timer);
      await this._drain();
      await this.handlers.ctx.retention.join(DRAIN_RETENTION_MS);
      const ws = this._ws;
      if (ws && ws.readyState !== WebSocket.CLOSED) {
        const closed = new Promise((resolve) => ws.once('close', resolve));
        if (ws.readyState === WebSocket.CONNECTING) ws.terminate();
        else ws.close(1000, 'executor stopping');
        const timer = setTimeout(() => ws.terminate(), CLOSE_TIMEOUT_MS);
        await closed;
        clearTimeout(timer);
      }
      this.log.info('relay client: connection to Relay stopped');
      for (const f of this._onStop.splice(0)) f();
      this._markStopped();
    }
    return this.stopped;
  }

  /** Wait (up to DRAIN_REQUESTS_MS) for the requests taken to be answered and their replies sent. */
  async _drain() {
    let timer;
    const deadline = new Promise((resolve) => (timer = setTimeout(resolve, DRAIN_REQUESTS_MS)));
    const idle = this._held === 0 ? Promise.resolve() : new Promise((resolve) => this._idleWaiters.push(resolve));
    const outbox = this._outbox;
    await Promise.race([idle.then(() => outbox?.flushed()), deadline]);
    clearTimeout(timer);
    if (this._held > 0) {
      const held = this._held;
      this.log.info(`relay client: stopping with ${held} request(s) still being served; their replies are dropped`);
    }
  }

  /** `textIn` with the key blanked: in the URL's path whatever its length, elsewhere from 8 characters on
   * (blanking every "e" of a line for a key "e" would spell the key out). */
  _redact(textIn) {
    let out = String(textIn);
    for (const form of new Set([encodeURIComponent(this._key), this._key])) {
      out = out.split(`/${encodeURIComponent(this.app)}/${form}`).join(`/${encodeURIComponent(this.app)}/***`);
      if (this._key.length >= REDACT_ANYWHERE_MIN) out = out.split(form).join('***');
    }
    return out;
  }

  _noteProblem(problem) {
    const redacted = this._redact(problem);
    if (redacted && redacted !== this._lastProblem) this.log.warn(`relay client: ${redacted}; reconnecting`);
    this._lastProblem = redacted;
  }

  _open() {
    if (this._stopping) return;
    const ws = new WebSocket(this._url, {
      handshakeTimeout: OPEN_TIMEOUT_MS,
      ca: this._ca,
      maxPayload: this._maxFrameBytes,
      perMessageDeflate: false,
      followRedirects: false,
    });
    this._ws = ws;
    let retry = Retry.SOON;
    let openedAt;
    let pinger;
    let outbox;
    let first = true;
    let refused = false; // answered with an HTTP status: the abort that follows is no other problem
    let tooBig = false; // a frame over maxFrameBytes: ws closes the socket itself (1009), Relay did not

    ws.on('unexpected-response', (req, res) => {
      refused = true;
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('end', () => {
        const bodyText = Buffer.concat(chunks).toString('utf8').slice(0, 500);
        this._noteProblem(`Relay refused the connection (${res.statusCode}): ${bodyText}`);
        retry = retryAfterStatus(res.statusCode);
        ws.terminate();
      });
      res.on('error', () => ws.terminate());
    });
    ws.on('open', () => {
      openedAt = Date.now();
      this.connected = true;
      this._noteProblem('');
      this.log.info(`relay client: connected to ${this.shownUrl} as executor ${this.executorId}`);
      outbox = new Outbox(ws, this._sendQueueSize);
      this._outbox = outbox;
      let awaitingPong = null;
      ws.on('pong', () => {
        clearTimeout(awaitingPong);
        awaitingPong = null;
      });
      pinger = setInterval(() => {
        if (awaitingPong) return;
        ws.ping();
        awaitingPong = setTimeout(() => {
          this._noteProblem('Relay did not answer a ping in time');
          ws.terminate();
        }, PING_TIMEOUT_MS);
      }, PING_INTERVAL_MS);
      ws.once('close', () => clearTimeout(awaitingPong));
    });
    ws.on('message', (data, isBinary) => {
      if (isBinary) {
        this.log.warn('relay client: ignoring a binary frame from Relay');
        return;
      }
      const textFrame = data.toString('utf8');
      if (first) {
        first = false; // the handshake: Relay speaks first, with executor_info
        this._reply(outbox, this.handlers.answer(textFrame));
        return;
      }
      this._take(textFrame, outbox, ws);
    });
    ws.on('error', (err) => {
      const tls = openedAt === undefined ? tlsFailure(err) : null;
      if (tls === 'certificate') {
        this._noteProblem(`Relay's certificate is not trusted: ${err.message}`);
        retry = Retry.REFUSED;
      } else if (tls === 'handshake') {
        const reason = opensslReason(err);
        this._noteProblem(`TLS handshake with Relay failed (is this port serving TLS, wss://?): ${reason}`);
        retry = Retry.REFUSED;
      } else if (err && err.code === 'WS_ERR_UNSUPPORTED_MESSAGE_LENGTH') {
        tooBig = true; // as relay_client words it
        this._noteProblem(
          `Relay sent a frame larger than maxFrameBytes (${this._maxFrameBytes} bytes); closed the socket (1009)`,
        );
      } else if (!this._stopping && !refused) {
        this._noteProblem(`Connection to Relay lost: ${err && err.message}`);
      }
    });
    ws.on('close', (code) => {
      clearInterval(pinger);
      this.connected = false;
      outbox?.close();
      if (this._outbox === outbox) this._outbox = null;
      if (this._ws === ws) this._ws = null;
      if (this._stopping) return;
      if (openedAt !== undefined) {
        if (!tooBig) this._noteProblem(`Relay closed the connection (code ${code})`);
        retry = retryAfterClose(code);
      }
      const lasted = openedAt === undefined ? 0 : Date.now() - openedAt;
      this._inARow = retry === this._last && lasted < STEADY_MS ? this._inARow + 1 : 1;
      this._last = retry;
      this._timer = setTimeout(() => this._open(), reconnectDelay(retry, this._inARow));
    });
  }

  _take(textFrame, outbox, ws) {
    if (this._stopping) {
      this._refuse(textFrame, STOPPING, outbox, ws);
      return;
    }
    if (this._held >= this._maxHeld) {
      const why = `relay client: busy, ${this._held} requests in progress or waiting for one of ` +
        `${this._maxConcurrent} turns; not served, ask again later`;
      this._refusedBusy += 1;
      if (this._refusedBusy === 1) this.log.warn(why);
      else this.log.debug?.(why);
      this._refuse(textFrame, why, outbox, ws);
      return;
    }
    if (this._refusedBusy > 0) {
      this.log.info(`relay client: taking requests again; ${this._refusedBusy} refused while busy`);
      this._refusedBusy = 0;
    }
    this._held += 1;
    const served = (async () => {
      await this._turns.take();
      try {
        const reply = this._stopping
          ? this.handlers.refuse(textFrame, STOPPING)
          : await this.handlers.answer(textFrame);
        if (reply !== undefined) await outbox.put(reply);
      } finally {
        this._turns.give();
        this._held -= 1;
        if (this._held === 0) for (const wake of this._idleWaiters.splice(0)) wake();
      }
    })();
    served.catch((err) => this.log.error(`relay client: serving a request failed: ${this._redact(err && err.stack)}`));
  }

  /** Answer a request not served with its refusal. While that reply waits for room in the send queue
   * (Relay reads none), no more frames are read: the requests of a flood stay in the socket's buffers,
   * and Relay's own, not in this process's memory as refusals waiting to be queued. */
  _refuse(textFrame, reason, outbox, ws) {
    const reply = this.handlers.refuse(textFrame, reason);
    if (reply === undefined) return;
    const full = outbox.full;
    const queued = outbox.put(reply);
    if (!full) return;
    if (outbox.refusalsWaiting++ === 0) ws.pause();
    queued.finally(() => {
      if (--outbox.refusalsWaiting === 0) ws.resume();
    });
  }

  _reply(outbox, pending) {
    Promise.resolve(pending)
      .then((reply) => (reply !== undefined ? outbox.put(reply) : undefined))
      .catch((err) => this.log.error(`relay client: answering Relay failed: ${this._redact(err && err.stack)}`));
  }
}

module.exports = { Connection, Retry, tlsFailure, reconnectDelay, retryAfterStatus, retryAfterClose, checkUrl, checkKey, websocketUrl };
