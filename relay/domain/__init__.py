"""What Relay does, above the stores and below the HTTP API: operator actions, adoption of dead instances."""
