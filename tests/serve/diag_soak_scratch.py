import asyncio, os
from live_server import API_KEY
from specjax.serve import soak
from specjax.serve.soak import SoakConfig, run_soak

def test_diag(server):
    kinds = os.environ.get("KINDS")
    if kinds is not None:
        soak.INJECTED = tuple(k for k in kinds.split(",") if k)
    rate = float(os.environ.get("RATE", "0.15"))
    config = SoakConfig(url=server.url, api_key=API_KEY, duration=float(os.environ.get("DUR", "8")), clients=8,
                        max_tokens_cap=100, prompts=4, seeds=1, inject_rate=rate if soak.INJECTED else 0,
                        request_timeout=60, idle_timeout=20)
    r = asyncio.run(run_soak(config))
    print(soak.format_table(r, False))
    print("\n".join(r.problems))
