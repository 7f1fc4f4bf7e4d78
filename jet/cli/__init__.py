"""The `jet` commands: `main` (the command group), `options` (the options and helpers every role's command
shares: the one module of this package that roles import), `up`, `progress`, `enqueue`, `feed`, `status`,
`server` and `init`. `python -m jet.cli` is the `jet` command."""
