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

import concurrent.futures
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallas_kernels.cpu_matmul import PANEL, quant
from specjax.models.checkpoint_io import (CheckpointError, module_from_params,
                                          refuse_leftovers, tensor_taker)
from specjax.models.config import DTYPES, ModelConfig, RopeScaling
from specjax.models.families import family_for_gguf, family_for_hf
from specjax.models.fused import FUSED_GROUPS
from specjax.models.hf_checkpoint import model_from_params
from specjax.models.llama import Llama, layer_param_shapes
from specjax.models.roles import LAYER, gguf_layer_names

TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K",
                "Q6_K")

# our layer param -> GGUF tensor name after "blk.{i}." (Gemma 3's sandwich norms included:
# its norm weights are stored as llama.cpp computes with them, 1 + w, as specjax does)
_LAYER_NAMES = gguf_layer_names()
_PARAM_OF = {name: key for key, name in _LAYER_NAMES.items()}
_TRANSPOSED = {name for name, role in LAYER.items() if role.transposed and role.gguf}
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
        self._map = data._mmap  # the mmap.mmap under it, for `release`
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
            self.tensors, self._spans = {}, {}
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
                self._spans[name] = (start + offset, nbytes)
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

    def release(self, name: str) -> None:
        """Drop tensor `name`'s pages from this process once it has been read (repacked or
        dequantized): the OS keeps them in its page cache, but they stop counting to the
        process, so loading peaks near the packed model's size, not the file's plus it."""
        start, nbytes = self._spans[name]
        first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the tensor
        end = (start + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
        if end > first and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, first, end - first)

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
    family = family_for_gguf(arch)

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
        dtype=dtype or "float32", model_type=family.model_type,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=None if eos is None else int(eos),
        **family.gguf_fields(hidden, heads, head_dim, layers, int(window) if window else None))


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
    """Load a GGUF file (architectures: `families.FAMILIES`; tensors `TENSOR_TYPES`) into a
    `Llama`. `dtype` None: computing in float32 with
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
    permuted = family_for_hf(config.model_type).gguf_permuted
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

    def packed(layers: list[list[str]], key: str) -> np.ndarray:
        """Layers (each one tensor, or the parts of a fused projection side by side) packed
        into one page-aligned array: on a CPU `jax.device_put` then shares it, no copy.
        `key`: the parameter each name is one of ("embed", "q_proj")."""
        for name in (n for parts in layers for n in parts):
            file_shape = (V, D) if key in ("embed", "lm_head") else \
                tuple(reversed(shapes[_PARAM_OF[name.split(".", 2)[-1]]]))
            if name not in file.tensors:
                raise CheckpointError(f"tensor {name!r} is missing from the GGUF file {path}")
            if file.tensors[name][1] != file_shape:
                raise CheckpointError(f"tensor {name!r} has shape {file.tensors[name][1]}, "
                                      f"expected {file_shape}")
        return quant.pack_gguf_stack(
            [[(unpermuted(n, file.tensors[n][2]), file.tensors[n][0].name) for n in parts]
             for parts in layers],
            release=lambda i: [file.release(n) for n in layers[i]])

    def dequantized(name: str) -> np.ndarray:
        array = unpermuted(name, file.dequantized(name))
        file.release(name)
        return array

    tensors = {name: dequantized(name) for name in file.tensors
               if name not in _IGNORED and name not in kept}
    take = tensor_taker(tensors, jnp.dtype(config.dtype), f"the GGUF file {path}")
    params = {"embed": (jax.device_put(packed([["token_embd.weight"]], "embed")[0])
                        if "token_embd.weight" in kept else take("token_embd.weight", (V, D))),
              "final_norm": take("output_norm.weight", (D,))}
    if not config.tie_word_embeddings:
        params["lm_head"] = (jax.device_put(packed([["output.weight"]], "lm_head")[0])
                             if "output.weight" in kept
                             else take("output.weight", (D, V), transpose=True))
    leftovers = lambda: refuse_leftovers(tensors, f"GGUF file has tensors this "
                                                  f"{config.model_type} config does not use")
    types = {key: [file.tensors[n][0].name for n in layer_names(key)] for key in kept_keys}
    if any(len(set(t)) > 1 for t in types.values()):
        layers = _mixed_layers(config, shapes, kept_keys, types, packed, take)
        leftovers()
        params["layers"] = dict(enumerate(layers))
        return module_from_params(lambda: _abstract(config, layers), params)
    # q/k/v and gate/up packed side by side where their layers share one type: the layout
    # the steps run (`models.fused`), made here without a copy of the weights.
    fused = {group: parts for group, parts in FUSED_GROUPS.items()
             if all(f"{p}_proj" in kept_keys for p in parts)
             and len({types[f"{p}_proj"][0] for p in parts}) == 1}
    layers = {}
    for group, parts in fused.items():
        names = [layer_names(f"{p}_proj") for p in parts]
        layers[f"{group}_proj"] = jax.device_put(packed(
            [list(layer) for layer in zip(*names)], group))
        if all(f"{p}_bias" in shapes for p in parts):
            layers[f"{group}_bias"] = np.concatenate(
                [np.stack([take(n, shapes[f"{p}_bias"]) for n in layer_names(f"{p}_bias")])
                 for p in parts], axis=-1)
    done = {f"{p}_{kind}" for parts in fused.values() for p in parts for kind in ("proj", "bias")}
    layers.update({
        key: (jax.device_put(packed([[n] for n in layer_names(key)], key))
              if key in kept_keys else
              np.stack([take(name, shape, key in _TRANSPOSED) for name in layer_names(key)]))
        for key, shape in shapes.items() if key not in done})
    leftovers()
    params["layers"] = layers
    if not fused:
        return model_from_params(config, params)
    return module_from_params(lambda: _abstract(config, layers), params)


def _abstract(config: ModelConfig, layers) -> Llama:
    """A `Llama` (traced abstractly) whose layers have `layers`' shapes: a dict of stacked
    arrays, or a list of one dict a layer (the unrolled layout)."""
    model = Llama(config, rngs=nnx.Rngs(0))
    params = lambda d: nnx.Dict({k: nnx.Param(jnp.zeros(v.shape, v.dtype)) for k, v in d.items()})
    model.layers = params(layers) if isinstance(layers, dict) else \
        nnx.List([params(layer) for layer in layers])
    return model


def _mixed_layers(config, shapes, kept_keys, types, packed, take) -> list[dict]:
    """The layers, one dict each (the unrolled layout), of a model whose quantized layers mix
    types (a `_K_M` file's `ffn_down` and `attn_v`: Q4_K
    and Q6_K) in the unrolled layout, each layer's weights in its own type: read at its own
    size, where one stacked array would widen them all to one layout. A group (q/k/v,
    gate/up) is packed fused in each layer whose parts share a type."""
    jobs, layers = [], []
    for i in range(config.num_layers):
        layer, done = {}, set()
        for group, parts in FUSED_GROUPS.items():
            keys = [f"{p}_proj" for p in parts]
            if all(k in kept_keys for k in keys) and len({types[k][i] for k in keys}) == 1:
                jobs.append((i, f"{group}_proj", [f"blk.{i}.{_LAYER_NAMES[k]}" for k in keys],
                             group))
                done.update(keys)
                if all(f"{p}_bias" in shapes for p in parts):
                    layer[f"{group}_bias"] = np.concatenate(
                        [take(f"blk.{i}.{_LAYER_NAMES[f'{p}_bias']}", shapes[f"{p}_bias"])
                         for p in parts])
                    done.update(f"{p}_bias" for p in parts)
        for key, shape in shapes.items():
            if key in done:
                continue
            name = f"blk.{i}.{_LAYER_NAMES[key]}"
            if key in kept_keys:
                jobs.append((i, key, [name], key))
            else:
                layer[key] = take(name, shape, key in _TRANSPOSED)
        layers.append(layer)

    def one(job) -> None:
        i, key, names, role = job
        layers[i][key] = jax.device_put(packed([names], role)[0])

    with concurrent.futures.ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(one, jobs))
    return layers


# ---- writing: what llama.cpp loads (and what the tests build tiny files with) ---------------

def gguf_metadata(config: ModelConfig) -> dict[str, Any]:
    """The architecture keys of a GGUF describing `config` (no tokenizer keys). A config that
    is not what llama.cpp assumes of its family's files (`Family.gguf_fields`) is refused,
    the fields named: the file would load as another model."""
    family = family_for_hf(config.model_type)
    arch = family.gguf_architecture
    if arch is None:
        raise ValueError(f"{family.title} has no GGUF architecture")
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
    window = min((w for w in config.sliding_windows or () if w is not None), default=None)
    if window is not None:
        meta[f"{arch}.attention.sliding_window"] = window
    assumed = family.gguf_fields(config.hidden_size, config.num_heads, config.head_dim,
                                 config.num_layers, window)
    held = config.replace(**assumed)
    # query_pre_attn_scalar None and head_dim scale alike: compare the scale they give
    fields = ["query_scale" if f == "query_pre_attn_scalar" else f for f in assumed]
    wrong = [f"{f} {getattr(config, f)!r} (llama.cpp: {getattr(held, f)!r})" for f in fields
             if getattr(config, f) != getattr(held, f)]
    if wrong:
        raise ValueError(f"this {family.title} config is not what llama.cpp assumes of a "
                         f"{arch} GGUF: {', '.join(wrong)}")
    return meta


def gguf_tensors(model: Llama) -> dict[str, np.ndarray]:
    """`model`'s weights as float32 arrays in llama.cpp's layout: `[out, in]`, q/k rows
    interleaved for Llama architectures (the inverse of `load_gguf`)."""
    config = model.config
    permuted = family_for_hf(config.model_type).gguf_permuted
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
