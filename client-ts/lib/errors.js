'use strict';

// The client's errors. ConnectRefused: connect() will not start (DBOS not launched, an executor id
// that is not this launch's own, an app that is not DBOS's). A URL, key or option that no Relay
// could take is a TypeError or RangeError, thrown by connect() too, naming the part at fault and
// never the key.

class RelayClientError extends Error {
  constructor(message) {
    super(message);
    this.name = this.constructor.name;
  }
}

class ConnectRefused extends RelayClientError {}

module.exports = { RelayClientError, ConnectRefused };
