"""`python -m optimum.habana.serve [MODEL] [transformers serve's options] [--use_flash_attention ...]`

transformers' OpenAI-compatible server (`transformers serve`) on the Gaudi classes: the same options, endpoints,
streaming and `--continuous-batching`, plus the attention flags, which become the defaults of every request (a
request's own `generation_config` may set them). MODEL is a local checkpoint folder or a hub repo id; without one,
the embedded SmolLM2-135M-Instruct is served under that name. See docs/serving.md.

A bad option (the attention's, transformers serve's, or one the command line cannot parse) is one line on stderr
and exit status 2, before the model loads; a model that does not load, or a continuous-batching engine that cannot
build its cache, is one line and exit status 2 too, before the port opens.
"""

import inspect
import os
import sys
from typing import Annotated, Any

import typer

from optimum.habana.cli.common import check_environment
from optimum.habana.transformers.attention_flags import ATTENTION_FLAG_HELP, ATTENTION_FLAG_NAMES
from optimum.habana.utils.model_loading import DEFAULT_MODEL_NAME


def flag_parameter(name: str) -> inspect.Parameter:
    option = typer.Option(f"--{name}", f"--{name.replace('_', '-')}", help=ATTENTION_FLAG_HELP[name])
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[bool, option])


PROG = "python -m optimum.habana.serve"


def fail(message: str) -> None:
    """One line on stderr, exit status 2 (a usage error)."""
    typer.echo(f"optimum.habana.serve: {(message.strip().splitlines() or ['failed'])[0]}", err=True)
    raise typer.Exit(2)


API_KEY_ENV = "OPTIMUM_HABANA_API_KEY"  # as server.API_KEY_ENV (imported lazily there)
OWN_PARAMETERS = [
    inspect.Parameter(
        "api_key",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            str | None,
            typer.Option(
                "--api-key",
                envvar=API_KEY_ENV,
                show_envvar=True,
                show_default=False,
                help="Every route but /health then needs `Authorization: Bearer <key>` (401 otherwise). Prefer the "
                f"environment variable {API_KEY_ENV}: a command line is visible to the machine's other users.",
            ),
        ],
    ),
    inspect.Parameter(
        "max_body_bytes",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[
            int | None,
            typer.Option(
                "--max-body-bytes",
                show_default=False,
                help="The largest request body, in bytes: a larger one is a 413, refused before it is read whole. "
                "Default: the body of the longest prompt the model's context can hold (each character a JSON escape), "
                "and 1 MiB.",
            ),
        ],
    ),
    inspect.Parameter(
        "admin_routes",
        inspect.Parameter.KEYWORD_ONLY,
        default=False,
        annotation=Annotated[
            bool,
            typer.Option(
                "--enable-admin-routes",
                help="Keep transformers' /reset (unloads the served model for every client) and /load_model "
                "(for the served model only: the server is pinned to it); off, they are 404.",
            ),
        ],
    ),
]


def serve(**options: Any) -> None:
    from .server import GaudiServe, ServeStartError

    flags = {name: options.pop(name) for name in ATTENTION_FLAG_NAMES}
    if options["api_key"] is None and os.environ.get(API_KEY_ENV) == "":  # click reads an empty variable as unset
        fail(f"{API_KEY_ENV} is set but empty: give it the key clients must send, or unset it to serve without one.")
    try:  # the options are checked first, then the model loads, then it serves
        GaudiServe(attention_flags=flags, **options)
    except (ValueError, OSError, ServeStartError) as error:  # ServeOptionError, a family without a Gaudi class, ...
        fail(str(error))
    except KeyboardInterrupt:  # Ctrl-C before uvicorn serves (while the model loads); uvicorn handles it after
        typer.echo("optimum.habana.serve: interrupted before serving (Ctrl-C); nothing was started.", err=True)
        raise typer.Exit(130) from None


def command() -> typer.Typer:
    """A typer app whose one command takes transformers serve's parameters and the flags."""
    from .server import SERVE_PARAMETERS

    parameters = [parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY) for parameter in SERVE_PARAMETERS]
    parameters += OWN_PARAMETERS + [flag_parameter(name) for name in ATTENTION_FLAG_NAMES]
    serve.__signature__ = inspect.Signature(parameters)  # typer reads the options from it
    serve.__doc__ = (
        "Serve MODEL (default: the embedded "
        f"{DEFAULT_MODEL_NAME}) with transformers' OpenAI-compatible server and the Gaudi attention."
    )
    app = typer.Typer(add_completion=False)
    app.command()(serve)
    return app


def main(argv: list[str] | None = None) -> None:
    """Run the command; what the command line cannot parse (`--port abc`, an unknown option) is one line too."""
    from transformers.utils.import_utils import is_serve_available
    from typer.exceptions import TyperException

    if not is_serve_available():
        from .server import SERVING_INSTALL_HINT

        sys.exit(f"optimum.habana.serve needs transformers' serving dependencies: {SERVING_INSTALL_HINT}")
    parser = typer.main.get_command(command())
    check_environment("optimum.habana.serve")
    try:
        status = parser.main(args=sys.argv[1:] if argv is None else argv, prog_name=PROG, standalone_mode=False)
    except typer.Abort:
        sys.exit(130)
    except TyperException as error:  # click's usage errors, as typer carries them
        if not hasattr(error, "format_message"):
            raise
        typer.echo(f"optimum.habana.serve: {error.format_message()} ({PROG} --help lists the options)", err=True)
        sys.exit(2)
    if isinstance(status, int) and status:
        sys.exit(status)


if __name__ == "__main__":
    main()
