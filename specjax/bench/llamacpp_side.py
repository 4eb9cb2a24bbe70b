"""The llama.cpp side of `python -m specjax.bench decode --llama-cpp PYTHON`: run by another
interpreter (a virtualenv with `llama-cpp-python`, which specjax never installs), so it imports
nothing from specjax. Reads one JSON command per line on stdin, answers one JSON line each:

    {"load": path, "threads": n, "n_ctx": n}            -> {"version": ...}
    {"prompt": [ids], "max_tokens": n}                 -> {"seconds": s, "tokens": [ids]}

Generation is greedy (top_k 1) from a fresh context, timed around the whole call: prompt
evaluation plus max_tokens new tokens, as the specjax side is timed."""
import json
import sys
import time


def main() -> None:
    import llama_cpp
    model = None
    for line in sys.stdin:
        command = json.loads(line)
        if "load" in command:
            model = llama_cpp.Llama(command["load"], n_ctx=command["n_ctx"],
                                    n_threads=command["threads"], n_batch=512, verbose=False)
            answer = {"version": llama_cpp.__version__}
        else:
            model.reset()
            tokens = []
            start = time.perf_counter()
            for token in model.generate(command["prompt"], temp=0.0, top_k=1, reset=True):
                tokens.append(token)
                if len(tokens) == command["max_tokens"]:
                    break
            answer = {"seconds": time.perf_counter() - start, "tokens": tokens}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
