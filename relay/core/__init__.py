"""The pure core: states, liveness, peer choice and the failover policy. No I/O, no clock of its own."""
