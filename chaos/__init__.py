"""The chaos harness: real executors, real Relay, seeded and replayable faults."""
