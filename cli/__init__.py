"""The ``pomona`` command line (cli/main.py): one typer app over the flows, tasks and engine."""
