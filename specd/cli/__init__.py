"""The `specd` command line (`main`), one module per group of subcommands."""
