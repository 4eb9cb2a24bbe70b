"""The llama.cpp side of `python -m specjax.bench decode --llama-cpp PYTHON`: run by another
interpreter (a virtualenv with `llama-cpp-python`, which specjax never installs), so it imports
nothing from specjax. Reads one JSON command per line on stdin, answers one JSON line each:

    {"load": path, "threads": n, "n_ctx": n, "prompt_lookup": k} -> {"version": ...}
    {"prompt": [ids], "max_tokens": n, "stop": [ids]}            -> {"seconds": s, "tokens": [ids]}

Generation is greedy (top_k 1) from a fresh context, timed around the whole call: prompt
evaluation plus up to max_tokens new tokens (ending after a token in "stop"), as the specjax
side is timed. prompt_lookup k > 0 drafts with llama-cpp-python's prompt-lookup decoding
(LlamaPromptLookupDecoding, k tokens per draft)."""
import json
import sys
import time


def main() -> None:
    import llama_cpp
    model = None
    for line in sys.stdin:
        command = json.loads(line)
        if "load" in command:
            draft = None
            if command.get("prompt_lookup"):
                from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
                draft = LlamaPromptLookupDecoding(num_pred_tokens=command["prompt_lookup"])
            model = llama_cpp.Llama(command["load"], n_ctx=command["n_ctx"],
                                    n_threads=command["threads"], n_batch=512, verbose=False,
                                    draft_model=draft)
            answer = {"version": llama_cpp.__version__}
        else:
            model.reset()
            tokens, stop = [], set(command.get("stop", ()))
            start = time.perf_counter()
            for token in model.generate(command["prompt"], temp=0.0, top_k=1, reset=True):
                tokens.append(token)
                if len(tokens) == command["max_tokens"] or token in stop:
                    break
            answer = {"seconds": time.perf_counter() - start, "tokens": tokens}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
