"""The `deltaserve` command line: subcommands, engine flags, `serve` and `bench serve`."""
