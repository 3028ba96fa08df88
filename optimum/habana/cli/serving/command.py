"""`python -m optimum.habana.serve [MODEL] [transformers serve's options] [--use_flash_attention ...]`

transformers' OpenAI-compatible server (`transformers serve`) on the Gaudi classes: the same options, endpoints,
streaming and `--continuous-batching`, plus the attention flags, which become the defaults of every request (a
request's own `generation_config` may set them). MODEL is a local checkpoint folder or a hub repo id; without one,
the embedded SmolLM2-135M-Instruct is served under that name. See docs/serving.md.
"""

import inspect
import sys
from typing import Annotated, Any

import typer

from optimum.habana.transformers.attention_flags import ATTENTION_FLAG_HELP, ATTENTION_FLAG_NAMES
from optimum.habana.utils.model_loading import DEFAULT_MODEL_NAME


def flag_parameter(name: str) -> inspect.Parameter:
    option = typer.Option(f"--{name}", f"--{name.replace('_', '-')}", help=ATTENTION_FLAG_HELP[name])
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[bool, option])


def serve(**options: Any) -> None:
    from .server import GaudiServe, check_attention_options

    flags = {name: options.pop(name) for name in ATTENTION_FLAG_NAMES}
    try:  # before the model loads
        check_attention_options(options["attn_implementation"], flags)
    except ValueError as error:
        raise typer.BadParameter(str(error)) from None
    try:
        GaudiServe(attention_flags=flags, **options)
    except (ValueError, OSError) as error:  # the model: a family without a Gaudi class, a missing folder...
        typer.echo(f"optimum.habana.serve: {str(error).strip().splitlines()[0]}", err=True)
        raise typer.Exit(2) from None


def command() -> typer.Typer:
    """A typer app whose one command takes transformers serve's parameters and the flags."""
    from .server import SERVE_PARAMETERS

    parameters = [parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY) for parameter in SERVE_PARAMETERS]
    parameters += [flag_parameter(name) for name in ATTENTION_FLAG_NAMES]
    serve.__signature__ = inspect.Signature(parameters)  # typer reads the options from it
    serve.__doc__ = (
        "Serve MODEL (default: the embedded "
        f"{DEFAULT_MODEL_NAME}) with transformers' OpenAI-compatible server and the Gaudi attention."
    )
    app = typer.Typer(add_completion=False)
    app.command()(serve)
    return app


def main(argv: list[str] | None = None) -> None:
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        from .server import SERVING_INSTALL_HINT

        sys.exit(f"optimum.habana.serve needs transformers' serving dependencies: {SERVING_INSTALL_HINT}")
    command()(args=sys.argv[1:] if argv is None else argv, prog_name="python -m optimum.habana.serve")


if __name__ == "__main__":
    main()
