"""Real processes and network pieces shared by the tests, the chaos harness and the benchmarks.

- :mod:`harness.postgres`: one PostgreSQL server (embedded, or ``RELAY_TEST_DATABASE_URL``);
- :mod:`harness.relay`: ``relay serve`` in a subprocess and its configuration;
- :mod:`harness.executors`: real DBOS executors (:mod:`harness.executor_app`) in subprocesses;
- :mod:`harness.simulated`: a hand-written executor for protocol fuzzing and load;
- :mod:`harness.fuzzing`: an executor that sends exactly the frames a test scripts, valid or not;
- :mod:`harness.proxy` and :mod:`harness.balancer`: a TCP proxy that cuts connections and a
  TCP load balancer in front of several Relay instances;
- :mod:`harness.keys`, :mod:`harness.ports`, :mod:`harness.waiting`: the test keys, free
  ports and ``assert_eventually``;
- :mod:`harness.stats`: the one percentile function behind every reported figure.

Nothing here imitates the system under test, and nothing here imports ``tests``.
"""
