"""One module per CLI subcommand: add_arguments(parser), run(args) -> int."""
