"""GGUF files (llama.cpp's and Ollama's format) -> `Llama`, read with the `gguf` package.

A GGUF holds the hyper-parameters and the tokenizer as metadata under llama.cpp's key names,
and the weights in llama.cpp's layout: linear weights `[out, in]` like Hugging Face's, but the
q/k rows of Llama-architecture files interleaved for llama.cpp's rotary (its converter permutes
them; undone here so the rotate-half RoPE of `models/rope.py` applies).

Quantized projections (and the embedding, and the LM head) stay quantized by default: their
blocks are repacked for the CPU matmul kernel (`pallas_kernels.cpu_matmul.quant`), no float
copy made, so a step reads about the file's size. Naming a `dtype` ("float32", "bfloat16")
dequantizes every tensor to it at load instead, as the engine did before.
"""
from __future__ import annotations

import os
import struct
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.cpu_matmul import PANEL, quant
from specjax.models.checkpoint_io import CheckpointError, refuse_leftovers, tensor_taker
from specjax.models.config import DTYPES, ModelConfig, RopeScaling
from specjax.models.hf_checkpoint import model_from_params
from specjax.models.llama import Llama, layer_param_shapes

# GGUF's `general.architecture` -> our model_type. llama.cpp writes Mistral files as "llama".
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                 "gemma3": "gemma3_text"}
# Architectures whose q/k rows llama.cpp's converter permutes (its "normal" rotary); Qwen's
# use NeoX rotary there and are stored as Hugging Face has them.
_PERMUTED = {"llama", "mistral"}
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                "Q6_K")

# our layer param -> GGUF tensor name after "blk.{i}."
_LAYER_NAMES = {
    "input_norm": "attn_norm.weight", "post_norm": "ffn_norm.weight",
    "q_proj": "attn_q.weight", "k_proj": "attn_k.weight", "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "o_bias": "attn_output.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
    "gate_proj": "ffn_gate.weight", "up_proj": "ffn_up.weight", "down_proj": "ffn_down.weight",
}
# Gemma 3's sandwich norms (`ffn_norm` is the norm before its MLP, as in Llama files). Its
# norm weights are stored as llama.cpp computes with them, 1 + w: as specjax does.
_SANDWICH_NAMES = {"attn_out_norm": "post_attention_norm.weight",
                   "ffn_out_norm": "post_ffw_norm.weight"}
_LAYER_NAMES.update(_SANDWICH_NAMES)
# llama.cpp's Gemma 3: every sixth layer global, the others a sliding window rotated with a
# base of 10,000 (neither is in the file).
GEMMA3_GLOBAL_EVERY, GEMMA3_LOCAL_ROPE_BASE = 6, 10000.0
_TRANSPOSED = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
# Tensors llama.cpp keeps beside the weights that nothing here computes with.
_IGNORED = {"rope_freqs.weight"}


def is_gguf(path: str | os.PathLike) -> bool:
    """A file (not a folder) whose first four bytes are GGUF's magic."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


# GGUF metadata value types -> numpy scalar types (8 is a string, 9 an array).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B",
            10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFFile:
    """A GGUF file's metadata (`meta`: key -> value, arrays as lists) and tensors (`tensors`:
    name -> (type, shape in row-major order, bytes as a read-only memory map)).

    The header is parsed here rather than by `gguf.GGUFReader`, which builds a memory-map view
    per array element (seconds for a 49k-token vocabulary); the `gguf` package dequantizes."""

    def __init__(self, path: str | os.PathLike):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise FileNotFoundError(f"GGUF file {str(self.path)!r} does not exist")
        data = np.memmap(self.path, dtype=np.uint8, mode="r")
        self._view, self._at = memoryview(data), 4
        try:
            if bytes(data[:4]) != b"GGUF":
                raise ValueError("it does not start with GGUF's magic bytes")
            version = self._scalar("<I")
            if version not in (2, 3):
                raise ValueError(f"GGUF version {version} (supported: 2, 3; big-endian files "
                                 "are not)")
            n_tensors, n_meta = self._scalar("<Q"), self._scalar("<Q")
            self.meta = {}
            for _ in range(n_meta):
                key = self._string()
                self.meta[key] = self._value(self._scalar("<I"))
            infos = []
            for _ in range(n_tensors):
                name = self._string()
                dims = [self._scalar("<Q") for _ in range(self._scalar("<I"))]
                infos.append((name, dims, self._scalar("<I"), self._scalar("<Q")))
            align = int(self.meta.get("general.alignment", 32))
            start = -(-self._at // align) * align
            self.tensors = {}
            for name, dims, kind, offset in infos:
                try:
                    qtype = GGMLQuantizationType(kind)
                except ValueError:
                    raise CheckpointError(f"GGUF tensor {name!r} has unknown type {kind}") from None
                block, size = GGML_QUANT_SIZES[qtype]
                shape = tuple(int(d) for d in reversed(dims))
                nbytes = int(np.prod(shape)) // block * size
                if start + offset + nbytes > len(data):
                    raise ValueError(f"tensor {name!r} runs past the end of the file")
                raw = data[start + offset:start + offset + nbytes]
                self.tensors[name] = (qtype, shape, raw.reshape(shape[:-1] + (-1,)))
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{self.path} is not a readable GGUF file: {e}") from None

    def _scalar(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._view, self._at)
        self._at += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._scalar("<Q")
        text = str(self._view[self._at:self._at + n], "utf-8")
        self._at += n
        return text

    def _value(self, kind: int):
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, n = self._scalar("<I"), self._scalar("<Q")
            if item == _STRING:
                return [self._string() for _ in range(n)]
            if item in _SCALARS:
                values = np.frombuffer(self._view, _SCALARS[item], n, self._at)
                self._at += values.nbytes
                return values.tolist()
            return [self._value(item) for _ in range(n)]
        if kind not in _SCALARS:
            raise ValueError(f"unknown metadata value type {kind}")
        value = self._scalar(_SCALARS[kind])
        return bool(value) if kind == 7 else value

    def dequantized(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in row-major order (GGUF lists dimensions innermost
        first)."""
        from gguf.quants import dequantize
        qtype, shape, raw = self.tensors[name]
        # One call over every block: row by row, the package loops in Python.
        return np.asarray(dequantize(raw.reshape(1, -1), qtype), np.float32).reshape(shape)


def gguf_types(path: str | os.PathLike) -> list[str]:
    """The tensor types of a GGUF file, the most bytes first ("Q4_1", "Q8_0", "F32")."""
    sizes: dict[str, int] = {}
    for qtype, _, raw in GGUFFile(path).tensors.values():
        sizes[qtype.name] = sizes.get(qtype.name, 0) + raw.nbytes
    return sorted(sizes, key=sizes.get, reverse=True)


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Every metadata key of a GGUF file with its value (strings decoded, arrays as lists)."""
    return GGUFFile(path).meta


def gguf_config(meta: dict[str, Any], dtype: str | None = None) -> ModelConfig:
    """The `ModelConfig` a GGUF's metadata describes; unsupported architectures and rotary
    scalings are named."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported (supported: "
                              f"{', '.join(ARCHITECTURES)})")

    def get(key: str, default: Any = KeyError) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is KeyError:
            raise CheckpointError(f"GGUF metadata {arch}.{key} is missing")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise CheckpointError("GGUF attention.value_length differs from key_length: not "
                              "supported")
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise CheckpointError("GGUF rope.dimension_count is not the head size (partial "
                              "rotary): not supported")
    scaling_type = get("rope.scaling.type", "none")
    if scaling_type == "linear":
        scaling = RopeScaling(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif scaling_type in ("none", None):
        scaling = None
    else:
        raise CheckpointError(f"GGUF rope scaling {scaling_type!r} is not supported "
                              "(supported: none, linear, llama3's rope_freqs)")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(get("vocab_size", len(tokens) if tokens is not None else KeyError))
    window = get("attention.sliding_window", None)
    layers = int(get("block_count"))
    windows = None if not window else (int(window),) * layers
    gemma = {}
    if arch == "gemma3":
        # llama.cpp scales Gemma 3 27B's queries by hidden / heads, every other size's by
        # the head size (no key holds it).
        scalar = hidden // heads if hidden == 5376 else head_dim
        gemma = dict(sandwich_norms=True, hidden_act="gelu_pytorch_tanh", embed_scale=True,
                     query_pre_attn_scalar=scalar, rope_local_theta=GEMMA3_LOCAL_ROPE_BASE)
        if window:
            windows = tuple(None if (i + 1) % GEMMA3_GLOBAL_EVERY == 0 else int(window)
                            for i in range(layers))
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_layers=layers, num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv", heads)), head_dim=head_dim,
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=_decimal(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=_decimal(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        tie_word_embeddings=False,  # decided by the tensors (no output.weight), below
        qkv_bias=arch == "qwen2", qk_norm=arch in ("qwen3", "gemma3"),
        sliding_windows=windows,
        dtype=dtype or "float32", model_type=ARCHITECTURES[arch],
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=None if eos is None else int(eos), **gemma)


def _decimal(value: float) -> float:
    """A float32 from the file as the shortest decimal it rounds from (1e-05, not
    9.999999747378752e-06), as the model's own config.json has it."""
    return float(str(np.float32(value)))


def _llama3_scaling(factors: np.ndarray, config: ModelConfig) -> RopeScaling:
    """llama.cpp stores Llama 3.1's rotary scaling as per-frequency divisors (`rope_freqs`);
    recover the Hugging Face parameters that give the same divisors, or refuse."""
    from specjax.models.rope import inverse_frequencies
    plain = inverse_frequencies(config.replace(rope_scaling=None))
    factor = float(factors.max())
    for low, high, original in ((1.0, 4.0, 8192), (1.0, 4.0, 4096), (1.0, 2.0, 8192)):
        scaling = RopeScaling("llama3", factor, low, high, original)
        if np.allclose(plain / inverse_frequencies(config.replace(rope_scaling=scaling)),
                       factors, rtol=1e-3):
            return scaling
    raise CheckpointError("GGUF rope_freqs does not match Llama 3's rotary scaling for any "
                          "known parameters: not supported")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleave (`[out, in]` or a bias `[out]`)."""
    rows = w.shape[0]
    return (w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def load_gguf(path: str | os.PathLike, dtype: str | None = None) -> Llama:
    """Load a GGUF file (architectures llama, mistral, qwen2, qwen3; tensors F32, F16, BF16,
    Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) into a `Llama`. `dtype` None: computing in float32 with
    quantized weights kept quantized (module docstring); a `dtype`: every weight dequantized
    to it. Never downloads."""
    from gguf import GGMLQuantizationType

    file = GGUFFile(path)
    config = gguf_config(file.meta, dtype)
    supported = {GGMLQuantizationType[t] for t in TENSOR_TYPES}
    for name, (qtype, _, _) in file.tensors.items():
        if qtype not in supported:
            raise CheckpointError(f"GGUF tensor {name!r} has type {qtype.name}, which is not "
                                  f"supported (supported: {', '.join(TENSOR_TYPES)})")
    if "rope_freqs.weight" in file.tensors:
        factors = file.dequantized("rope_freqs.weight").astype(np.float64).reshape(-1)
        config = config.replace(rope_scaling=_llama3_scaling(factors, config))
    config = config.replace(tie_word_embeddings="output.weight" not in file.tensors)
    permuted = config.model_type in _PERMUTED
    heads = {"q": config.num_heads, "k": config.num_kv_heads}

    def unpermuted(name: str, array: np.ndarray) -> np.ndarray:
        role = name.split(".")[-2] if name.count(".") >= 2 else ""
        if permuted and role in ("attn_q", "attn_k"):
            array = _unpermute(array, heads[role[-1]])
        return array

    def keeps(name: str) -> bool:  # stays quantized: a supported type, whole panels of rows
        qtype, shape, _ = file.tensors.get(name, (None, (), None))
        return (dtype is None and qtype is not None and qtype.name in quant.FORMATS
                and len(shape) == 2 and shape[0] % PANEL == 0)

    L, V, D = config.num_layers, config.vocab_size, config.hidden_size
    shapes = layer_param_shapes(config)
    layer_names = lambda key: [f"blk.{i}.{_LAYER_NAMES[key]}" for i in range(L)]
    # A layer parameter stays quantized when it is in every layer (the layers stack).
    kept_keys = {key for key in _TRANSPOSED & set(shapes) if all(map(keeps, layer_names(key)))}
    kept = {n for key in kept_keys for n in layer_names(key)}
    kept |= {n for n in ("token_embd.weight", "output.weight") if keeps(n)}

    def packed(names: list[str], file_shape: tuple[int, ...]) -> np.ndarray:
        for name in names:
            if name not in file.tensors:
                raise CheckpointError(f"tensor {name!r} is missing from the GGUF file {path}")
            if file.tensors[name][1] != file_shape:
                raise CheckpointError(f"tensor {name!r} has shape {file.tensors[name][1]}, "
                                      f"expected {file_shape}")
        return quant.pack_gguf_stack([(unpermuted(n, file.tensors[n][2]),
                                       file.tensors[n][0].name) for n in names])

    tensors = {name: unpermuted(name, file.dequantized(name)) for name in file.tensors
               if name not in _IGNORED and name not in kept}
    take = tensor_taker(tensors, jnp.dtype(config.dtype), f"the GGUF file {path}")
    params = {"embed": (packed(["token_embd.weight"], (V, D))[0]
                        if "token_embd.weight" in kept else take("token_embd.weight", (V, D))),
              "final_norm": take("output_norm.weight", (D,))}
    if not config.tie_word_embeddings:
        params["lm_head"] = (packed(["output.weight"], (V, D))[0] if "output.weight" in kept
                             else take("output.weight", (D, V), transpose=True))
    params["layers"] = {
        key: (packed(layer_names(key), tuple(reversed(shape))) if key in kept_keys else
              np.stack([take(name, shape, key in _TRANSPOSED) for name in layer_names(key)]))
        for key, shape in shapes.items()}
    refuse_leftovers(tensors, f"GGUF file has tensors this {config.model_type} config does "
                              "not use")
    return model_from_params(config, params)


# ---- writing: what llama.cpp loads (and what the tests build tiny files with) ---------------

def gguf_metadata(config: ModelConfig) -> dict[str, Any]:
    """The architecture keys of a GGUF describing `config` (no tokenizer keys)."""
    arch = {v: k for k, v in ARCHITECTURES.items()}[config.model_type]
    if arch == "mistral":
        arch = "llama"  # llama.cpp's converter writes Mistral as llama
    if config.rope_scaling is not None and config.rope_scaling.rope_type != "linear":
        raise ValueError("writing llama3 rotary scaling to GGUF is not supported")
    meta = {"general.architecture": arch, f"{arch}.block_count": config.num_layers,
            f"{arch}.context_length": config.max_position_embeddings,
            f"{arch}.embedding_length": config.hidden_size,
            f"{arch}.feed_forward_length": config.intermediate_size,
            f"{arch}.attention.head_count": config.num_heads,
            f"{arch}.attention.head_count_kv": config.num_kv_heads,
            f"{arch}.attention.key_length": config.head_dim,
            f"{arch}.attention.value_length": config.head_dim,
            f"{arch}.rope.dimension_count": config.head_dim,
            f"{arch}.rope.freq_base": float(config.rope_theta),
            f"{arch}.attention.layer_norm_rms_epsilon": float(config.rms_norm_eps),
            f"{arch}.vocab_size": config.vocab_size}
    if config.rope_scaling is not None:
        meta[f"{arch}.rope.scaling.type"] = "linear"
        meta[f"{arch}.rope.scaling.factor"] = float(config.rope_scaling.factor)
    windows = {w for w in config.sliding_windows or () if w is not None}
    if arch == "gemma3":
        assumed = gguf_config({**meta, f"{arch}.attention.sliding_window": min(windows or {0})})
        fields = ("sliding_windows", "rope_local_theta", "query_scale", "sandwich_norms",
                  "hidden_act", "embed_scale")
        if any(getattr(config, f) != getattr(assumed, f) for f in fields):
            raise ValueError("this Gemma 3 config differs from what llama.cpp assumes of a "
                             "GGUF (every sixth layer global, local RoPE base 10,000, the "
                             "query scale of its size)")
        if windows:
            meta[f"{arch}.attention.sliding_window"] = windows.pop()
    elif windows:
        if len(windows) > 1 or None in config.sliding_windows:
            raise ValueError("GGUF holds one sliding window for every layer")
        meta[f"{arch}.attention.sliding_window"] = windows.pop()
    return meta


def gguf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """`model`'s weights as float32 arrays in llama.cpp's layout: `[out, in]`, q/k rows
    interleaved for Llama architectures (the inverse of `load_gguf`)."""
    config = model.config
    permuted = config.model_type in _PERMUTED
    f32 = lambda x: np.asarray(x[...] if isinstance(x, nnx.Variable) else x, np.float32)
    tensors = {"token_embd.weight": f32(model.embed), "output_norm.weight": f32(model.final_norm)}
    if not config.tie_word_embeddings:
        tensors["output.weight"] = np.ascontiguousarray(f32(model.lm_head).T)
    heads = {"q": config.num_heads, "k": config.num_kv_heads}
    for key, stacked in model.layer_params().items():
        for i in range(config.num_layers):
            array = f32(stacked[i])
            array = array.T if key in _TRANSPOSED else array
            role = _LAYER_NAMES[key].split(".")[0]
            if permuted and role in ("attn_q", "attn_k"):
                array = _permute(array, heads[role[-1]])
            tensors[f"blk.{i}.{_LAYER_NAMES[key]}"] = np.ascontiguousarray(array)
    return tensors


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    rows = w.shape[0]
    return (w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def write_gguf(path: str | os.PathLike, metadata: dict[str, Any],
               tensors: dict[str, np.ndarray], types: dict[str, str] | None = None) -> Path:
    """Write a GGUF file: `metadata` (Python values: bool, int, float, str, lists of them) and
    `tensors` (row-major, llama.cpp's layout) stored as `types[name]` (default F32). A
    float array is quantized by the `gguf` package; a uint8 array for a quantized type is
    taken as that type's blocks already made (how tests build K-quant files, which the
    package cannot quantize)."""
    import gguf
    from gguf.quants import quantize
    path = Path(path)
    meta = dict(metadata)
    writer = gguf.GGUFWriter(str(path), meta.pop("general.architecture"))
    for key, value in meta.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, list(value))
    for name, array in tensors.items():
        qtype = gguf.GGMLQuantizationType[(types or {}).get(name, "F32")]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, np.ascontiguousarray(array, np.float32))
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(name, np.ascontiguousarray(array, np.float16))
        else:
            data = array if array.dtype == np.uint8 else quantize(
                np.asarray(array, np.float32), qtype)
            writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
