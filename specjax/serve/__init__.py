"""An OpenAI-compatible HTTP server over the engine: `python -m specjax.serve`.

`create_app(llm, ServerSettings(...))` builds the FastAPI app; the engine runs in one
background thread (`engine_thread.EngineThread`) that the HTTP handlers feed through queues.
"""
from specjax.serve.app import Server, ServerSettings, create_app
from specjax.serve.chat import ChatTemplate
from specjax.serve.defaults import default_speculative_config, parse_speculative_config

__all__ = ["ChatTemplate", "Server", "ServerSettings", "create_app",
           "default_speculative_config", "parse_speculative_config"]
