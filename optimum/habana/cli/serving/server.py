"""transformers' server (`transformers serve`) with the Gaudi classes and the attention flags.

Everything that serves is transformers': its FastAPI app and routes (`/v1/chat/completions`, `/v1/completions`,
`/v1/responses`, ...), its request handlers, its generation and continuous-batching managers, uvicorn as it
configures it. Two things are ours:

- `GaudiModelManager`, transformers' model manager with a `_load_model` that builds the Gaudi class of the
  checkpoint's family (transformers' builds `getattr(transformers, config.architectures[0])`) and writes the
  attention flags into the model's generation config, from which every request's generation config is copied. It
  knows the embedded default model by its name.
- `GaudiServe`, transformers' `Serve` with that manager. `Serve.__init__` builds its manager itself, with no
  parameter for the class, so `GaudiServe.__init__` assembles the same parts in the same order. It takes exactly
  `Serve`'s options, plus the flags: an option a later transformers adds is refused by name, never ignored.
  Into that assembly go the declared routes (`routes`: the request models of `bodies` and `fields`, the doors
  closed), the request checks (`handlers`, `checks`), bounded and cancellable generation (`generation`), a
  continuous-batching cache sized to the work (`cache`), OpenAI-shaped errors, the API key, disconnect and
  shutdown handling (`app`), and the start-up checks (`options`), which run before the model loads.

transformers is not patched: `transformers serve` in the same process still loads the stock classes.
"""

import inspect
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from transformers import AutoConfig, PreTrainedModel
from transformers.cli.serve import ReasoningMode, Serve
from transformers.cli.serving.model_manager import ModelManager
from transformers.utils.import_utils import is_serve_available

from optimum.habana.transformers import ATTENTION_FLAG_NAMES, gaudi_model_class
from optimum.habana.transformers.attention_flags import check_flag_combination
from optimum.habana.transformers.continuous_batching import check_engine_serves
from optimum.habana.transformers.modeling_utils import ATTENTION_IMPLEMENTATIONS
from optimum.habana.utils.model_loading import DEFAULT_MODEL_NAME, resolve_model
from optimum.habana.utils.pretrained import load_tokenizer

from .cache import describe_cache, sized_for_cpu
from .checks import ServedModel
from .generation import SHUTDOWN, GaudiGenerationState, InFlightRequests, cancellation_error, context_length
from .options import ServeOptionError, check_api_key, check_compile_device, check_serve_options
from .options import chat_template_kwargs as parse_chat_template_kwargs
from .preparation import longest_token


logger = logging.getLogger(__name__)


SERVING_INSTALL_HINT = "pip install 'optimum-gaudi-flash[serving]'"


# transformers serve's options as its `Serve` declares them (typer annotations, defaults, help).
SERVE_PARAMETERS = tuple(
    parameter for parameter in inspect.signature(Serve.__init__).parameters.values() if parameter.name != "self"
)


# How GaudiServe passes them on, as Serve does.
MANAGER_OPTIONS = ("device", "dtype", "trust_remote_code", "attn_implementation", "quantization", "model_timeout")


CB_OPTIONS = ("block_size", "num_blocks", "max_batch_tokens", "max_memory_percent", "use_cuda_graph")


SERVER_OPTIONS = (
    "force_model",
    "continuous_batching",
    "compile",
    "decision_config",
    "host",
    "port",
    "enable_cors",
    "log_level",
)


def check_attention_options(attn_implementation: str | None, flags: Mapping[str, bool]) -> None:
    """Refuse an attention the Gaudi classes cannot run, or flags that contradict it, before anything loads."""
    if attn_implementation is not None and attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(
            f"--attn-implementation {attn_implementation!r} is not an attention of the Gaudi classes: take one of "
            f"{', '.join(ATTENTION_IMPLEMENTATIONS)}, or leave it out and choose with --use_flash_attention."
        )
    implied = ATTENTION_IMPLEMENTATIONS.get(attn_implementation) if attn_implementation is not None else None
    if implied is False and flags.get("use_flash_attention"):
        raise ValueError(
            f"--use_flash_attention contradicts --attn-implementation {attn_implementation!r} (the default "
            "attention): drop one of them."
        )
    check_flag_combination({**flags, "use_flash_attention": bool(flags.get("use_flash_attention") or implied)})


def describe_attention(model: PreTrainedModel) -> str:
    """The attention every request runs unless its own generation config sets the flags."""
    config = model.generation_config
    flags = [name for name in ATTENTION_FLAG_NAMES if getattr(config, name, None)]
    attention = "the fused kernel" if getattr(config, "use_flash_attention", None) else "the default attention"
    return f"{type(model).__name__} on {model.device}, {attention} ({', '.join(flags) or 'no flags set'})"


class ServeStartError(RuntimeError):
    """The server cannot serve (its model or its engine could not be built): one line, and the server does not start."""


class ModelLoadError(ServeStartError):
    """The pinned model could not be loaded; the message says which and why, in one line."""


class GaudiModelManager(ModelManager):
    """transformers' model manager, loading the Gaudi class of each checkpoint with the server's flags.

    It knows what it serves (`served`: the name, context length and vocabulary requests are checked against) and
    lists that model at `/v1/models`, where transformers lists the hub cache (a 500 on a machine without one).
    Once the server shuts down (`shutting_down`) it loads nothing: the models it unloads stay unloaded, and a request
    that would load one again gets a 503.
    """

    def __init__(self, *args: Any, attention_flags: Mapping[str, bool] | None = None, **kwargs: Any) -> None:
        # Set before the base class runs: it validates, then loads the pinned model.
        self.attention_flags = {name: value for name, value in (attention_flags or {}).items() if value}
        self.continuous_batching = bool(kwargs.get("continuous_batching"))
        self.served = ServedModel(str(kwargs.get("force_model") or ""), None, None, self.continuous_batching)
        self.has_chat_template = True
        self.longest_token: int | None = None
        self.loaded_at = int(time.time())
        self.shutting_down = False
        super().__init__(*args, **kwargs)

    def load_model_and_processor(self, *args: Any, **kwargs: Any) -> tuple[PreTrainedModel, Any]:
        if self.shutting_down:
            raise cancellation_error(SHUTDOWN)
        return super().load_model_and_processor(*args, **kwargs)

    def get_gen_models(self, cache_dir: str | None = None) -> list[dict]:
        """`/v1/models`: the served model, in OpenAI's model object."""
        return [{"id": self.served.name, "object": "model", "created": self.loaded_at, "owned_by": "optimum-habana"}]

    def _validate_args(self) -> None:
        check_attention_options(self.attn_implementation, self.attention_flags)
        chosen, self.attn_implementation = self.attn_implementation, None  # transformers' list lacks the Gaudi names
        try:
            super()._validate_args()
        finally:
            self.attn_implementation = chosen

    @staticmethod
    def checkpoint(model_id: str) -> str:
        """What `from_pretrained` loads: the embedded default model by its name, anything else as given."""
        return str(resolve_model(None).path) if model_id == DEFAULT_MODEL_NAME else model_id

    def _load_processor(self, model_id_and_revision: str, gguf_file: str | None = None) -> Any:
        if model_id_and_revision.split("@", 1)[0] == DEFAULT_MODEL_NAME:
            processor = load_tokenizer(resolve_model(None))
        else:
            processor = super()._load_processor(model_id_and_revision, gguf_file=gguf_file)
        self.has_chat_template = getattr(processor, "chat_template", None) is not None
        self.longest_token = longest_token(processor)
        return processor

    def _load_model(
        self,
        model_id_and_revision: str,
        tqdm_class: type | None = None,
        progress_callback: Callable | None = None,
        gguf_file: str | None = None,
    ) -> PreTrainedModel:
        model_id, revision = model_id_and_revision.split("@", 1)
        checkpoint = self.checkpoint(model_id)
        kwargs: dict[str, Any] = {
            "revision": revision,
            "attn_implementation": self.attn_implementation,
            "dtype": self.dtype,
            "device_map": self.device,
            "trust_remote_code": self.trust_remote_code,
            "tqdm_class": tqdm_class,
        }
        quantization_config = self.get_quantization_config()
        if quantization_config is not None:
            kwargs["quantization_config"] = quantization_config
        if gguf_file is not None:
            kwargs["gguf_file"] = gguf_file
        if progress_callback is not None:
            progress_callback({"status": "loading", "model": model_id_and_revision, "stage": "config"})
        model_type = AutoConfig.from_pretrained(checkpoint, **kwargs).model_type
        model = gaudi_model_class(model_type).from_pretrained(checkpoint, **kwargs)
        for name, value in self.attention_flags.items():
            setattr(model.generation_config, name, value)
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.served = ServedModel(
            self.force_model or model_id,
            context_length(model),
            getattr(config, "vocab_size", None),
            self.continuous_batching and hasattr(model, "init_continuous_batching"),
            self.longest_token,
        )
        if self.served.continuous_batching:  # before the line that says it is served
            check_engine_serves(model, remedy="Serve it without --continuous-batching.")
        logger.warning("Serving %s: %s.", model_id, describe_attention(model))
        return model


class GaudiServe(Serve):
    """transformers' `Serve` with `GaudiModelManager`: the same options, parts and order, plus the flags, with every
    request checked and every generation bounded and cancellable.

    With no model named, the embedded default model is served (transformers loads models on demand instead).
    Raises `ServeOptionError` (a ValueError) for a bad option before anything loads, `ModelLoadError` when the
    model does not load.
    """

    def __init__(
        self,
        attention_flags: Mapping[str, bool] | None = None,
        api_key: str | None = None,
        admin_routes: bool = False,
        max_body_bytes: int | None = None,
        **options: Any,
    ) -> None:
        if not is_serve_available():
            raise ImportError(
                "Serving needs transformers' serving dependencies (fastapi, uvicorn, openai, pydantic): "
                f"{SERVING_INSTALL_HINT}"
            )
        import uvicorn
        from transformers import ContinuousBatchingConfig
        from transformers.cli.serving.server import build_server
        from transformers.cli.serving.systemone import SystemOneHandler
        from transformers.cli.serving.transcription import TranscriptionHandler
        from transformers.cli.serving.utils import set_torch_seed
        from transformers.utils import logging as transformers_logging

        from .app import SHUTDOWN_GRACE_S, GracefulServer, default_body_limit, install
        from .handlers import GaudiChatCompletionHandler, GaudiCompletionHandler, GaudiResponseHandler
        from .routes import declare_routes

        unknown = set(options) - {parameter.name for parameter in SERVE_PARAMETERS}
        if unknown:
            raise TypeError(f"GaudiServe got options that transformers serve does not have: {sorted(unknown)}")
        options = {parameter.name: parameter.default for parameter in SERVE_PARAMETERS} | options
        check_serve_options(options)
        check_api_key(api_key)
        check_body_limit(max_body_bytes)
        check_attention_options(options["attn_implementation"], attention_flags or {})
        manager_options = {name: options.pop(name) for name in MANAGER_OPTIONS}
        cb_options = {name: options.pop(f"cb_{name}") for name in CB_OPTIONS}
        cb_options = {name: value for name, value in cb_options.items() if value is not None}
        if "block_size" in cb_options:  # transformers' name since 5.17 (block_size is deprecated, with a warning)
            cb_options["page_size"] = cb_options.pop("block_size")
        chat_template_kwargs = chat_template_options(options.pop("chat_template_kwargs"), options.pop("reasoning"))
        force_model, continuous_batching, compile, decision_config, host, port, enable_cors, log_level = (
            options.pop(name) for name in SERVER_OPTIONS
        )
        default_seed, non_blocking = options.pop("default_seed"), options.pop("non_blocking")
        if options:  # an option of a later transformers serve that this class does not pass on
            raise TypeError(f"optimum.habana.serve does not support transformers serve's {sorted(options)} yet.")
        if manager_options["model_timeout"] != SERVE_DEFAULTS["model_timeout"]:
            logger.warning("--model-timeout has no effect: the server is pinned to its model, which stays loaded.")

        if default_seed is not None:
            set_torch_seed(default_seed)
        transformers_logging.get_logger("transformers").setLevel(transformers_logging.log_levels[log_level.lower()])
        model = force_model or DEFAULT_MODEL_NAME
        try:
            self._model_manager = GaudiModelManager(
                **manager_options,
                continuous_batching=continuous_batching,
                force_model=model,
                attention_flags=attention_flags,
            )
        except ValueError:  # a family without a Gaudi class, ...: the message says it
            raise
        except Exception as error:  # a damaged checkpoint, a hub id that is nowhere, a device that fails...
            logger.debug("Loading %s failed.", model, exc_info=True)
            first_line = (str(error).strip().splitlines() or [""])[0]
            raise ModelLoadError(f"{model} could not be loaded: {type(error).__name__}: {first_line}") from error
        served = self._model_manager.served
        loaded, _ = self._model_manager.load_model_and_processor(self._model_manager.process_model_name(model))
        if compile:
            announce_compile(loaded.device.type)
        if continuous_batching:
            cb_options = sized_for_cpu(cb_options, loaded, served.context_length)
        self._requests = InFlightRequests()
        self._generation_state = GaudiGenerationState(
            continuous_batching=continuous_batching,
            compile=compile,
            cb_config=ContinuousBatchingConfig(**cb_options) if cb_options else None,
        )
        try:  # a Ctrl-C or a failure while the engine starts leaves nothing running
            if served.continuous_batching:  # the engine starts now, with the server's settings: its cache is known
                engine = self._generation_state.get_manager(served.name, use_cb=True)
                start_engine(engine, loaded)
                logger.warning("Continuous batching: %s.", describe_cache(engine))
            shared = {"model_manager": self._model_manager, "generation_state": self._generation_state}
            self._chat_handler = GaudiChatCompletionHandler(**shared, chat_template_kwargs=chat_template_kwargs)
            self._completion_handler = GaudiCompletionHandler(**shared)
            self._response_handler = GaudiResponseHandler(**shared, chat_template_kwargs=chat_template_kwargs)
            self._transcription_handler = TranscriptionHandler(self._model_manager, self._generation_state)
            self._systemone_handler = SystemOneHandler(
                **shared, chat_template_kwargs=chat_template_kwargs, decision_config=decision_config
            )
            app = build_server(
                self._model_manager,
                self._chat_handler,
                completion_handler=self._completion_handler,
                response_handler=self._response_handler,
                transcription_handler=self._transcription_handler,
                systemone_handler=self._systemone_handler,
                generation_state=self._generation_state,
                enable_cors=enable_cors,
            )
            handlers = {"chat": self._chat_handler, "completion": self._completion_handler}
            declare_routes(app, handlers | {"response": self._response_handler}, self._model_manager, admin_routes)
            body_limit = max_body_bytes or default_body_limit(served)
            install(app, self._requests, api_key, body_limit)
            announce_doors(host, port, api_key, admin_routes)
            logger.warning(
                "Request bodies up to %.1f MiB (--max-body-bytes %d%s); a larger one is a 413.",
                body_limit / 1024**2,
                body_limit,
                "" if max_body_bytes else ": the longest prompt the context holds, and 1 MiB",
            )
            config = uvicorn.Config(
                app, host=host, port=port, log_level="info", timeout_graceful_shutdown=SHUTDOWN_GRACE_S
            )
            self.server = GracefulServer(config, on_shutdown=lambda: self._requests.cancel_all(SHUTDOWN))
        except BaseException:
            self._generation_state.shutdown()
            raise
        if non_blocking:
            self.start_server()
        else:
            try:
                self.server.run()
            except KeyboardInterrupt:  # uvicorn shut down on Ctrl-C, then raised it again: exit as interrupted
                raise SystemExit(130) from None
            finally:
                self._generation_state.shutdown()

    def kill_server(self) -> None:
        """transformers' `kill_server`, once every request in flight was cancelled (each gets its error) and no request
        can load the model again (it unloads it under the requests still being prepared)."""
        self._requests.cancel_all(SHUTDOWN)
        self._model_manager.shutting_down = True
        super().kill_server()


def announce_compile(device: str) -> None:
    """`--compile` once the model is on its device: refused where generate() would compile nothing, else said."""
    check_compile_device(device)
    logger.warning(
        "--compile: generate() compiles each request's decode step (torch.compile, static KV cache) on %s; the "
        "first requests of each length wait for the compilation.",
        device,
    )


def check_body_limit(max_body_bytes: int | None) -> None:
    if max_body_bytes is not None and (isinstance(max_body_bytes, bool) or max_body_bytes < 1):
        raise ServeOptionError(
            f"--max-body-bytes {max_body_bytes} is not a size: give a positive number of bytes (or leave it out: "
            "the longest prompt the model's context holds, and 1 MiB)."
        )


def start_engine(engine: Any, model: PreTrainedModel) -> None:
    """The continuous-batching engine started with its paged cache built, else a ServeStartError in one line
    (transformers' own traceback of the failure is silenced: the line says it)."""
    from transformers.cli.serving.utils import CBWorkerDeadError

    engine_logger = logging.getLogger("ContinuousBatchingLogger")
    level = engine_logger.level
    engine_logger.setLevel(logging.CRITICAL)
    try:
        engine.init_cb(model)
    except CBWorkerDeadError as error:
        raise ServeStartError(
            f"{error} Lower --cb-num-blocks or --cb-block-size, or leave them out: on CPU the cache is then sized "
            "to the model's context."
        ) from None
    finally:
        engine_logger.setLevel(level)


def announce_doors(host: str, port: int, api_key: str | None, admin_routes: bool) -> None:
    """The start-up lines that say who may use the server."""
    if api_key:
        logger.warning("API key required: every route but /health answers 401 without `Authorization: Bearer <key>`.")
    else:
        logger.warning(
            "No API key: any client that reaches %s:%s is served (--api-key or %s to require one).",
            host,
            port,
            API_KEY_ENV,
        )
    if admin_routes:
        logger.warning("Admin routes on: /reset and /load_model answer %s.", "key holders" if api_key else "anyone")


API_KEY_ENV = "OPTIMUM_HABANA_API_KEY"


SERVE_DEFAULTS = {parameter.name: parameter.default for parameter in SERVE_PARAMETERS}


def chat_template_options(chat_template_kwargs: str | None, reasoning: str) -> dict[str, Any]:
    """`--chat-template-kwargs` and `--reasoning` as transformers serve reads them."""
    options = parse_chat_template_kwargs(chat_template_kwargs)
    if reasoning == ReasoningMode.ON:
        options["enable_thinking"] = True
    elif reasoning == ReasoningMode.OFF:
        options["enable_thinking"] = False
    return options


__all__ = [
    "GaudiModelManager",
    "GaudiServe",
    "ModelLoadError",
    "ServeOptionError",
    "ServeStartError",
    "check_attention_options",
]
