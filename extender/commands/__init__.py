"""Subcommands of the `vramsched` CLI, one module each (discovered by `extender.cli`)."""
