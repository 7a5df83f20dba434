"""Self-speculation tooling: the skip-set search (`verispec self-tune`)."""
