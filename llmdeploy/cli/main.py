"""The `llmdeploy` command. Commands live in their own modules and register themselves here."""

from __future__ import annotations

import typer

from llmdeploy import __version__

app = typer.Typer(
    name="llmdeploy",
    help="Declarative deployment of LLM inference: a local engine behind an SLA-aware proxy with cloud overflow and gray release.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="rich",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmdeploy {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_version, is_eager=True, help="Show the version and exit."
    ),
) -> None:
    """llmdeploy: validate, plan and apply an llmdeploy.yaml."""


def _register_commands() -> None:
    import importlib
    import pkgutil

    import llmdeploy.cli as cli_pkg

    # each llmdeploy/cli/cmd_*.py exposes register(app); keeps main.py free of command logic
    # --help lists commands in the order of a user's day: validate, plan, apply..., canary, ..., down
    first = ["cmd_spec", "cmd_deploy", "cmd_operate"]
    names = [i.name for i in pkgutil.iter_modules(cli_pkg.__path__) if i.name.startswith("cmd_")]
    for name in sorted(names, key=lambda n: (first.index(n) if n in first else len(first), n)):
        importlib.import_module(f"llmdeploy.cli.{name}").register(app)


_register_commands()

if __name__ == "__main__":
    app()
