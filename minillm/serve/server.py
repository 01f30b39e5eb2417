"""Running the app: `serve` (the CLI's foreground server: listens at once, answers 503 while the model loads, shuts
down gracefully on SIGINT / SIGTERM) and `BackgroundServer` (a server on a thread, for notebooks and tests)."""
from __future__ import annotations

import contextlib
import signal
import threading
import time
from typing import Any, Callable, Iterator

import uvicorn

from minillm.config import EngineConfig, ServeConfig
from minillm.engine.llm_engine import LLMEngine
from minillm.interfaces import AdmissionPolicy
from minillm.serve.app import ServedModel, Serving, build_app
from minillm.serve.async_engine import AsyncEngine
from minillm.serve.live import EngineView
from minillm.serve.metrics import EngineMetrics

# In-flight requests get this long to finish after SIGINT / SIGTERM; then they are aborted and the process exits.
GRACEFUL_SHUTDOWN_S = 30


def attach(serving: Serving, engine: LLMEngine, name: str, sampling_defaults: dict | None = None) -> None:
    """Put `engine` behind `serving`: its observers (metrics, the live view) first, then the loop that steps it."""
    serving.metrics, serving.view = EngineMetrics(engine, name), EngineView(engine)
    serving.model = ServedModel(name, engine.tokenizer, engine.max_model_len, dict(sampling_defaults or {}))
    serving.engine = AsyncEngine(engine)


def serve(model: str, engine_config: EngineConfig, config: ServeConfig,
          load: Callable[[str, EngineConfig], tuple[Any, LLMEngine]], log: Callable[[str], None] = print) -> int:
    """Listen on config.host:port, load the model (503 meanwhile), serve until SIGINT / SIGTERM."""
    serving = Serving()
    server = uvicorn.Server(uvicorn.Config(build_app(serving, config), host=config.host, port=config.port,
                                           log_level="warning", timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S))
    engines: list = []

    def load_then_serve() -> None:
        while not server.started and not server.should_exit:
            time.sleep(0.05)
        if server.should_exit:
            return
        try:
            loaded, engine = load(model, engine_config)
            engines.append(engine)
            engine.warm_up()      # the first user's request does not pay for lazy initialization
        except BaseException as e:  # noqa: BLE001 -- the server exits with the reason instead of serving 503s
            log(f"error: {e}")
            server.should_exit = True
            engines.append(e)
            return
        name = config.served_model_name or model
        attach(serving, engine, name, loaded.sampling_defaults)
        log(f"minillm serve: {name} ready on http://{config.host}:{_port(server)}/v1 (Ctrl-C stops)")

    loader = threading.Thread(target=load_then_serve, name="minillm-load", daemon=True)
    loader.start()
    log(f"minillm serve: listening on http://{config.host}:{config.port} (loading {model} ...)")
    with _stopped_by_signals():
        server.run()
    log("minillm serve: stopped")
    loader.join()
    if serving.engine is not None:
        serving.engine.close()
    for e in engines:
        if not isinstance(e, BaseException):
            e.close()
    return 2 if any(isinstance(e, BaseException) for e in engines) else 0


@contextlib.contextmanager
def _stopped_by_signals() -> Iterator[None]:
    """uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal again for the previous handler:
    make that handler end the run quietly, so the cleanup after it runs and the command exits 0."""
    def stop(signum: int, frame: Any) -> None:
        raise _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except _Stop:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Stop(Exception):
    pass


def _port(server: uvicorn.Server) -> int:
    return server.servers[0].sockets[0].getsockname()[1] if server.servers else server.config.port


class BackgroundServer:
    """The app on a thread of this process, on a free loopback port: `with BackgroundServer(engine) as s:` then
    talk to `s.url` (an OpenAI base URL). Closing stops the server and the engine loop (not the LLMEngine)."""

    def __init__(self, engine: LLMEngine, name: str = "default", config: ServeConfig | None = None,
                 sampling_defaults: dict | None = None, admission: AdmissionPolicy | None = None) -> None:
        config = config or ServeConfig(port=0)
        self.serving = Serving()
        self.app = build_app(self.serving, config, admission)   # a bad admission policy fails here, first
        attach(self.serving, engine, name, sampling_defaults)
        self.engine, self.metrics, self.view = self.serving.engine, self.serving.metrics, self.serving.view
        self.server = uvicorn.Server(uvicorn.Config(self.app, host=config.host, port=config.port,
                                                    log_level="warning", timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, name="minillm-server", daemon=True)
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server did not start on {config.host}:{config.port}")
            time.sleep(0.02)
        self.base = f"http://{config.host}:{_port(self.server)}"
        self.url = self.base + "/v1"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join()
        self.engine.close()
        self.metrics.close()
        self.view.close()

    def __enter__(self) -> "BackgroundServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
