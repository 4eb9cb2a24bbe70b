"""An OpenAI-compatible HTTP server over the engine: `python -m specjax.serve`.

`create_app(llm, ServerSettings(...))` builds the FastAPI app; the engine runs in one
background thread (`engine_thread.EngineThread`) that the HTTP handlers feed through queues.
`build_server(app, host, port).run()` serves it with uvicorn plus the header timeout and the
bounded shutdown (`http_server.py`); middleware in `guard.py` and `hosts.py` bounds the rest.
"""
from specjax.serve.app import Server, ServerSettings, create_app
from specjax.chat import ChatTemplate
from specjax.serve.defaults import default_speculative_config, parse_speculative_config
from specjax.serve.http_server import build_server

__all__ = ["ChatTemplate", "Server", "ServerSettings", "build_server", "create_app",
           "default_speculative_config", "parse_speculative_config"]
