"""What a user touches: job specs, the CLI, the smoke zoo, reports."""
