"""The trainer: data, parallel model, loop."""
