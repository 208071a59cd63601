"""Load a local GGUF file (llama.cpp's format) into redwood's format.

`read_gguf(path)` returns the model config, every weight dequantized to a dense torch tensor under its
Hugging Face parameter name, and the useful metadata. `load_gguf_tokenizer(path)` builds the matching
Hugging Face fast tokenizer from the file's metadata.

Three details of the format matter here:

- GGUF lists dimensions innermost first, so a tensor of GGUF shape `[in, out]` is the row-major
  `[out, in]` matrix that Hugging Face stores (`GGUFTensorInfo.shape` is the reversed, row-major one).
- llama.cpp's converter reorders the rows of the Q and K projections of *llama*-architecture models
  so that each head's two rotary halves are interleaved (the layout of llama.cpp's own RoPE). redwood
  applies rotate-half RoPE, so those rows are put back. Qwen2 files are written without the reordering.
- Weights are block-quantized. The `gguf` package can dequantize every type, but its numpy code is
  slow on a small CPU, so this module decodes the supported block types with vectorized torch code
  (bit-exact with `gguf.quants.dequantize`; tests check this) a few thousand blocks at a time, which
  keeps the temporaries in cache (figures: docs/perf/cpu.md, "Figures cited from the source").

Speed is also why the header is parsed here rather than with `gguf.GGUFReader`, which builds a numpy
view per metadata element — slow for the large vocabulary arrays of a Qwen2.5 file (same page). The
`gguf` package still supplies the type table (`GGMLQuantizationType`, `GGML_QUANT_SIZES`).
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from redwood.config import ModelConfig, RopeScaling
from redwood.errors import ConfigError, ModelLoadError, RedwoodError, UnsupportedModelError
from redwood.progress import Progress

GGUF_MAGIC = b"GGUF"
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2")
SUPPORTED_TENSOR_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")

# Errors that parsing or decoding raise on a file whose bytes do not add up.
_CORRUPT_ERRORS = (
    ValueError,
    IndexError,
    KeyError,
    struct.error,
    OSError,
    OverflowError,
    UnicodeDecodeError,
    TypeError,
    MemoryError,
)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


@dataclass
class GGUFModel:
    """A GGUF file's model, dequantized: config, HF-named tensors, metadata and optional rope divisors."""

    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    # llama3-style rope scaling baked in by llama.cpp: [head_dim // 2] divisors of the inverse frequencies.
    rope_freqs: torch.Tensor | None = None


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face parameter name of a GGUF tensor name (None for tensors redwood does not use)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.match(gguf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


# ---------------------------------------------------------------------------------------------- opening
def _check_path(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelLoadError(f"no such file: {path}")
    if not path.is_file():
        raise ModelLoadError(f"{path} is not a file (expected a .gguf model file)")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(
            f"{path} is not a GGUF file (it starts with {magic!r}, a GGUF file starts with {GGUF_MAGIC!r})"
        )
    return path


def _corrupt(path: Path, detail: str) -> ModelLoadError:
    return ModelLoadError(
        f"{path} is truncated or corrupt ({detail}); delete it and download it again "
        f"(for a registry model: `redwood models pull <name>`)"
    )


# GGUF metadata value types (gguf.GGUFValueType) -> struct format; 8 is a string, 9 an array.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Truncated(Exception):
    """A read ran past the end of the file (or a count/length that cannot fit in it)."""


@dataclass
class GGUFTensorInfo:
    """One tensor's entry in a GGUF header. `dims` is in GGUF order (innermost first)."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    type_name: str
    offset: int  # absolute byte offset of the data in the file
    n_bytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        """Row-major (PyTorch / Hugging Face) shape."""
        return tuple(reversed(self.dims))


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # scalar and string fields
    arrays: dict[str, tuple[int, int]]  # array fields: key -> (element type id, length); contents not kept
    tensors: dict[str, GGUFTensorInfo]
    data_offset: int
    file_size: int


class _HeaderParser:
    """Reads a GGUF header (v2/v3, little-endian) from a buffer with `struct`.

    The `gguf` package's GGUFReader builds numpy views for every metadata element, which is slow for the
    large tokenizer arrays of a Qwen2.5 file (docs/perf/cpu.md, "Figures cited from the source"); this
    walks the same bytes, skipping the contents of array fields.
    """

    def __init__(self, buf, size: int) -> None:
        self.buf, self.size, self.pos = buf, size, 0

    def _unpack(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.pos + n > self.size:
            raise _Truncated(f"header ends early at byte {self.pos}")
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += n
        return value if len(value) > 1 else value[0]

    def _count(self, min_item_bytes: int, what: str) -> int:
        n = self._unpack("Q")
        if n * min_item_bytes > self.size - self.pos:
            raise _Truncated(f"{what} count {n} does not fit in the file")
        return n

    def _string(self) -> str:
        n = self._count(1, "string length")
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, vtype: int, keep: bool) -> Any:
        if vtype in _SCALAR_FORMATS:
            value = self._unpack(_SCALAR_FORMATS[vtype])
            if vtype == 6:
                # float32 fields: the shortest decimal that rounds to the same float32 (1e-06, not
                # 9.999999974752427e-07), i.e. the value the original config.json most likely held.
                value = float(str(np.float32(value)))
            return value
        if vtype == _STRING:
            if keep:
                return self._string()
            n = self._count(1, "string length")
            self.pos += n
            return None
        if vtype == _ARRAY:
            etype = self._unpack("I")
            if etype in _SCALAR_FORMATS:
                n = self._count(struct.calcsize(_SCALAR_FORMATS[etype]), "array")
                self.pos += n * struct.calcsize(_SCALAR_FORMATS[etype])
            elif etype == _STRING:
                n = self._count(8, "array")
                unpack, buf, pos, size = struct.unpack_from, self.buf, self.pos, self.size
                for _ in range(n):  # each string: u64 length, bytes
                    if pos + 8 > size:
                        raise _Truncated("string array runs past the end of the file")
                    pos += 8 + unpack("<Q", buf, pos)[0]
                if pos > size:
                    raise _Truncated("string array runs past the end of the file")
                self.pos = pos
            elif etype == _ARRAY:
                n = self._count(12, "array")
                for _ in range(n):
                    self._value(_ARRAY, keep=False)
            else:
                raise ValueError(f"unknown metadata array element type {etype}")
            return (etype, n)
        raise ValueError(f"unknown metadata value type {vtype}")

    def parse(self) -> GGUFHeader:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        magic = bytes(self.buf[0:4])
        if magic != GGUF_MAGIC:
            raise ValueError("bad magic")
        self.pos = 4
        version = self._unpack("I")
        if version & 0xFFFF == 0 and version:
            raise UnsupportedModelError("big-endian GGUF files are not supported")
        if version not in (2, 3):
            raise UnsupportedModelError(f"GGUF version {version} is not supported (redwood reads versions 2 and 3)")
        n_tensors = self._count(24, "tensor")  # name length, n_dims, type, offset: >= 24 bytes each
        n_kv = self._count(12, "metadata")
        metadata: dict[str, Any] = {}
        arrays: dict[str, tuple[int, int]] = {}
        for _ in range(n_kv):
            key = self._string()
            vtype = self._unpack("I")
            value = self._value(vtype, keep=True)
            if vtype == _ARRAY:
                arrays[key] = value
            else:
                metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("I")
            if not 1 <= n_dims <= _MAX_DIMS:
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            dims = tuple(int(d) for d in (self._unpack(f"{n_dims}Q") if n_dims > 1 else (self._unpack("Q"),)))
            type_id = self._unpack("I")
            offset = self._unpack("Q")
            infos.append((name, dims, type_id, offset))
        alignment = metadata.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"invalid general.alignment {alignment!r}")
        data_offset = -(-self.pos // alignment) * alignment

        tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, type_id, offset in infos:
            if name in tensors:
                raise ValueError(f"duplicate tensor {name}")
            try:
                qtype = GGMLQuantizationType(type_id)
                block, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError):
                raise UnsupportedModelError(
                    f"tensor {name} has GGML type id {type_id}, unknown to the installed gguf package; "
                    f"redwood supports {', '.join(SUPPORTED_TENSOR_TYPES)}"
                ) from None
            if dims[0] % block:
                raise ValueError(
                    f"tensor {name}: row length {dims[0]} is not a multiple of the {qtype.name} block size {block}"
                )
            n_bytes = int(np.prod(dims, dtype=object)) // block * type_size
            start = data_offset + offset
            if start + n_bytes > self.size:
                raise _Truncated(f"tensor {name} needs bytes {start}..{start + n_bytes} but the file has {self.size}")
            tensors[name] = GGUFTensorInfo(name, dims, type_id, qtype.name, start, n_bytes)
        return GGUFHeader(version, metadata, arrays, tensors, data_offset, self.size)


class _MappedFile:
    """A private (copy-on-write) memory map of a GGUF file plus its parsed header; a context manager."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {path}: {e}") from None
        try:
            self.header = _HeaderParser(self.mm, size).parse()
        except RedwoodError as e:
            self.close()
            raise type(e)(f"{path}: {e}") from None
        except (_Truncated, *_CORRUPT_ERRORS) as e:
            self.close()
            raise _corrupt(path, str(e) or type(e).__name__) from None

    def raw(self, info: GGUFTensorInfo) -> torch.Tensor:
        """The tensor's bytes as a uint8 tensor sharing the mapping (no copy)."""
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=info.n_bytes, offset=info.offset)

    def release(self, info: GGUFTensorInfo) -> None:
        """Drop the tensor's pages from this process's memory once it is decoded (they are clean copies of
        the file: read again on a later access), so a load does not also hold the whole file in its RSS."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = info.offset // page * page  # (pages shared with the neighbours: re-read if touched again)
        end = min(-(-(info.offset + info.n_bytes) // page) * page, len(self.mm))
        try:
            self.mm.madvise(mmap.MADV_DONTNEED, start, end - start)
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass  # a tensor view is still alive; the mapping is released with it

    def __enter__(self) -> "_MappedFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Parse a GGUF file's header (metadata and tensor table) without touching tensor data."""
    with _MappedFile(_check_path(path)) as f:
        return f.header


def _require(meta: dict[str, Any], key: str, path: Path) -> Any:
    value = meta.get(key)
    if value is None:
        raise ModelLoadError(f"{path}: GGUF metadata lacks {key!r}, which redwood needs to build the model")
    return value


def _config_from_metadata(meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise UnsupportedModelError(
            f"{path}: unsupported GGUF architecture {arch!r}; redwood loads GGUF files of architecture "
            f"{', '.join(SUPPORTED_GGUF_ARCHS)}"
        )
    embed = shapes.get("token_embd.weight")
    if embed is None or len(embed) != 2:
        raise ModelLoadError(f"{path}: missing tensor token_embd.weight (model.embed_tokens.weight)")
    # GGUF lists dimensions innermost first, [hidden, vocab]: the last one counts the rows.
    vocab_size = int(embed[-1])
    try:
        return _build_config(meta, shapes, path, arch, vocab_size)
    except ModelLoadError:
        raise
    except ConfigError as e:
        raise ModelLoadError(f"{path}: inconsistent GGUF metadata: {e}") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise ModelLoadError(
            f"{path}: GGUF metadata has a value of the wrong type ({e}); the file is corrupt"
        ) from None


def _build_config(
    meta: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Path, arch: str, vocab_size: int
) -> ModelConfig:
    num_heads = int(_require(meta, f"{arch}.attention.head_count", path))
    hidden = int(_require(meta, f"{arch}.embedding_length", path))
    head_dim = int(meta.get(f"{arch}.attention.key_length") or 0) or hidden // max(num_heads, 1)
    value_dim = meta.get(f"{arch}.attention.value_length")
    if value_dim is not None and int(value_dim) != head_dim:
        raise UnsupportedModelError(
            f"{path}: key length {head_dim} differs from value length {value_dim}; "
            f"redwood needs equal query/key and value head sizes"
        )
    rotary_dim = meta.get(f"{arch}.rope.dimension_count")
    if rotary_dim is not None and int(rotary_dim) != head_dim:
        raise UnsupportedModelError(
            f"{path}: partial rotary embeddings ({rotary_dim} of {head_dim} head dimensions) are not supported"
        )

    scaling = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type")
    if scaling_type not in (None, "none") and "rope_freqs.weight" not in shapes:
        if scaling_type != "linear":
            raise UnsupportedModelError(
                f"{path}: unsupported rope scaling {scaling_type!r}; redwood supports linear scaling and "
                f"llama3 scaling (as a rope_freqs tensor) in GGUF files"
            )
        scaling = RopeScaling(rope_type="linear", factor=float(meta.get(f"{arch}.rope.scaling.factor") or 1.0))

    eos_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = meta.get(key)
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    bos = meta.get("tokenizer.ggml.bos_token_id")

    return ModelConfig(
        arch=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(_require(meta, f"{arch}.feed_forward_length", path)),
        num_layers=int(_require(meta, f"{arch}.block_count", path)),
        num_heads=num_heads,
        num_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or num_heads),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6),
        rope_theta=float(meta.get(f"{arch}.rope.freq_base") or 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=int(_require(meta, f"{arch}.context_length", path)),
        tie_word_embeddings="output.weight" not in shapes,
        qkv_bias="blk.0.attn_q.bias" in shapes,
        o_bias="blk.0.attn_output.bias" in shapes,
        mlp_bias="blk.0.ffn_gate.bias" in shapes,
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos_ids),
    )


def _expected(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the config implies."""
    h, hd, ffn = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        out.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
                p + "mlp.gate_proj.weight": (ffn, h),
                p + "mlp.up_proj.weight": (ffn, h),
                p + "mlp.down_proj.weight": (h, ffn),
                p + "input_layernorm.weight": (h,),
                p + "post_attention_layernorm.weight": (h,),
            }
        )
        if config.qkv_bias:
            out.update(
                {
                    p + "self_attn.q_proj.bias": (q,),
                    p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,),
                }
            )
        if config.o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if config.mlp_bias:
            out.update(
                {p + "mlp.gate_proj.bias": (ffn,), p + "mlp.up_proj.bias": (ffn,), p + "mlp.down_proj.bias": (h,)}
            )
    return out


# ------------------------------------------------------------------------------------- dequantization
def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The little-endian float16 at byte `start` of each block, as float32 [n, 1]."""
    return blocks[:, start : start + 2].view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32] values: low nibbles first, then high nibbles (ggml's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes of a little-endian uint32 -> its 32 bits [n, 32] as uint8 (bit j at column j)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).reshape(qh.shape[0], 32)


# Each decoder turns `b` [n, bytes per block] into `out` [n, values per block] (float32 or the target dtype),
# with the same float32 operations, in the same order, as gguf.quants (so results are bit-identical).
def _dq_q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = (_nibbles(b[:, 2:18]).view(torch.int8) - 8).float()
    torch.mul(_f16(b, 0), q, out=out)


def _dq_q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 4:20]).float().mul_(_f16(b, 0))
    torch.add(q, _f16(b, 2), out=out)


def _dq_q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    q = _nibbles(b[:, 6:22]) | (_bits32(b[:, 2:6]) << 4)
    torch.mul(_f16(b, 0), (q.view(torch.int8) - 16).float(), out=out)


def _dq_q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    q = (_nibbles(b[:, 8:24]) | (_bits32(b[:, 4:8]) << 4)).float().mul_(_f16(b, 0))
    torch.add(q, _f16(b, 2), out=out)


def _dq_q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    torch.mul(b[:, 2:34].view(torch.int8).float(), _f16(b, 0), out=out)


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K: 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block, as float32 [n, 8]."""
    s = s.reshape(-1, 3, 4)
    lo, mid, hi = s[:, 0], s[:, 1], s[:, 2]
    scales = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=1)
    mins = torch.cat([mid & 0x3F, (hi >> 4) | ((mid >> 2) & 0x30)], dim=1)
    return scales.float(), mins.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K: [n, 128] bytes -> [n, 8, 32]: each 32-byte run gives a low-nibble then a high-nibble sub-block."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)


def _dq_q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc).unsqueeze(-1)
    dm = (_f16(b, 2) * mn).unsqueeze(-1)
    q = _k_nibbles(b[:, 16:144]).float().mul_(d)
    torch.sub(q, dm, out=out.view(n, 8, 32))


def _dq_q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc).unsqueeze(-1)
    dm = (_f16(b, 2) * mn).unsqueeze(-1)
    qh = b[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(1, 8, 1)
    q = (_k_nibbles(b[:, 48:176]) | ((qh & 1) << 4)).float().mul_(d)
    torch.sub(q, dm, out=out.view(n, 8, 32))


def _dq_q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 1, 64)
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = b[:, 192:208].view(torch.int8).float()
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(n, 8, 32)
    high = torch.cat([qh & 3, (qh >> 2) & 3, (qh >> 4) & 3, qh >> 6], dim=2).reshape(n, 8, 32)
    q = ((low | (high << 4)).view(torch.int8) - 32).reshape(n, 16, 16).float()
    torch.mul(d, q, out=out.view(n, 16, 16))


# type name -> (values per block, bytes per block, block decoder)
_BLOCK_DECODERS: dict[str, tuple[int, int, Callable[[torch.Tensor, torch.Tensor], None]]] = {
    "Q4_0": (32, 18, _dq_q4_0),
    "Q4_1": (32, 20, _dq_q4_1),
    "Q5_0": (32, 22, _dq_q5_0),
    "Q5_1": (32, 24, _dq_q5_1),
    "Q8_0": (32, 34, _dq_q8_0),
    "Q4_K": (256, 144, _dq_q4_k),
    "Q5_K": (256, 176, _dq_q5_k),
    "Q6_K": (256, 210, _dq_q6_k),
}
_CHUNK_VALUES = 1 << 20  # values decoded per step: the temporaries stay in cache

# ------------------------------------------------------------------------------- 4-bit groups of 32
# The block types whose values are q · step − offset with q ∈ [0, 15] and one (step, offset) per 32
# consecutive values of a row: what torch's int4 CPU kernel holds (groups of 32, a scale and a zero each),
# so `cpu_weights` can keep the file's own 4-bit grid instead of re-quantizing the dequantized floats.
INT4_GROUP_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _groups_q4_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d = _f16(b, 0)  # x = d · (q − 8) = q · d − 8d
    return _nibbles(b[:, 2:18]), d, 8 * d


def _groups_q4_1(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _nibbles(b[:, 4:20]), _f16(b, 0), -_f16(b, 2)  # x = d · q + m


def _groups_q4_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sc, mn = _k_scales(b[:, 4:16])  # x = (d · sc_j) · q − dmin · m_j per 32-value sub-block j
    return _k_nibbles(b[:, 16:144]).reshape(-1, 256), _f16(b, 0) * sc, _f16(b, 2) * mn


_GROUP_DECODERS = {"Q4_0": (32, 18, _groups_q4_0), "Q4_1": (32, 20, _groups_q4_1), "Q4_K": (256, 144, _groups_q4_k)}


def int4_groups(
    raw: np.ndarray | torch.Tensor, type_name: str, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 4-bit tensor's values as groups of 32 along each row: (q uint8 [N, K] in 0..15, step and offset
    float32 [N, K / 32]) with value = q · step − offset — the products `dequantize` computes (Q4_K: step =
    d · scale_j and offset = dmin · min_j in float32, as there). Types: INT4_GROUP_TYPES."""
    if type_name not in _GROUP_DECODERS:
        raise UnsupportedModelError(f"{type_name} is not a 4-bit group type ({', '.join(INT4_GROUP_TYPES)})")
    N, K = shape
    block_values, block_bytes, decode = _GROUP_DECODERS[type_name]
    data = _as_bytes(raw)
    if K % block_values or data.numel() != N * K // block_values * block_bytes:
        raise ModelLoadError(
            f"{type_name} tensor of shape {shape} has {data.numel()} bytes, "
            f"expected {N * K // block_values * block_bytes}"
        )
    blocks = data.reshape(-1, block_bytes)
    q = torch.empty(blocks.shape[0], block_values, dtype=torch.uint8)
    groups = block_values // 32
    step, offset = torch.empty(blocks.shape[0], groups), torch.empty(blocks.shape[0], groups)
    chunk = max(1, _CHUNK_VALUES // block_values)
    for s in range(0, blocks.shape[0], chunk):
        q[s : s + chunk], step[s : s + chunk], offset[s : s + chunk] = decode(blocks[s : s + chunk])
    return q.view(N, K), step.view(N, K // 32), offset.view(N, K // 32)


def _as_bytes(raw: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Flat uint8 view of a tensor's raw data (a numpy array from gguf, or bytes mapped from the file)."""
    if isinstance(raw, torch.Tensor):
        return raw.reshape(-1).view(torch.uint8)
    return torch.from_numpy(np.ascontiguousarray(raw).reshape(-1).view(np.uint8))


def dequantize(
    raw: np.ndarray | torch.Tensor, type_name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode one tensor's raw data into a new dense tensor of `shape` (row-major, Hugging Face order).

    `raw` is the tensor's bytes (a uint8 tensor, or any numpy array as `gguf` returns it). The result never
    shares memory with `raw`. Types: `SUPPORTED_TENSOR_TYPES`.
    """
    n_values = int(np.prod(shape, dtype=np.int64)) if shape else 1
    data = _as_bytes(raw)
    if type_name in ("F32", "F16", "BF16"):
        src_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[type_name]
        if data.numel() != n_values * src_dtype.itemsize:
            raise ModelLoadError(
                f"{type_name} tensor of shape {shape} has {data.numel()} bytes, "
                f"expected {n_values * src_dtype.itemsize}"
            )
        return data.view(src_dtype).to(dtype, copy=True).reshape(shape)
    if type_name not in _BLOCK_DECODERS:
        raise UnsupportedModelError(
            f"cannot dequantize type {type_name}; redwood supports {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    block_values, block_bytes, decode = _BLOCK_DECODERS[type_name]
    if n_values % block_values:
        raise ModelLoadError(f"{type_name} tensor of shape {shape} is not a whole number of blocks")
    n_blocks = n_values // block_values
    if data.numel() != n_blocks * block_bytes:
        raise ModelLoadError(
            f"{type_name} tensor of shape {shape} has {data.numel()} bytes, expected {n_blocks * block_bytes}"
        )
    blocks = data.reshape(n_blocks, block_bytes)
    out = torch.empty(n_blocks, block_values, dtype=dtype)
    step = max(1, _CHUNK_VALUES // block_values)
    for start in range(0, n_blocks, step):
        decode(blocks[start : start + step], out[start : start + step])
    return out.reshape(shape)


def unpermute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row interleaving of a Q or K projection (weight [out, in] or bias [out]).

    The converter stores, within each head of dim D, row (j, half) at position 2*j + half, where the
    Hugging Face row is half*D/2 + j. This puts every row back at half*D/2 + j.
    """
    rows = weight.shape[0]
    head_dim = rows // n_heads
    if rows % n_heads or head_dim % 2:
        raise ModelLoadError(f"cannot undo the Q/K permutation: {rows} rows do not split into {n_heads} heads")
    rest = tuple(weight.shape[1:])
    w = weight.reshape(n_heads, head_dim // 2, 2, *rest)
    return w.transpose(1, 2).reshape(rows, *rest).contiguous()


def permute_qk(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """The forward llama.cpp permutation (HF rotate-half layout -> interleaved); the inverse of `unpermute_qk`."""
    rows = weight.shape[0]
    rest = tuple(weight.shape[1:])
    w = weight.reshape(n_heads, 2, rows // n_heads // 2, *rest)
    return w.transpose(1, 2).reshape(rows, *rest).contiguous()


# ------------------------------------------------------------------------------------------ public API
def read_gguf(path: str | Path, dtype: torch.dtype = torch.float32, transform=None) -> GGUFModel:
    """Read and dequantize a llama or qwen2 GGUF file. Every tensor is a new `dtype` tensor (no file mapping).
    transform(hf_name, tensor) → what `tensors` holds instead, called as each tensor is dequantized (e.g.
    `cpu_weights.packer`: the packed projection, so the whole float model never exists at once). A transform
    with `takes_int4_groups(hf_name, shape)` true for a tensor of a 4-bit group type (INT4_GROUP_TYPES) gets
    `from_int4_groups(hf_name, q, step, offset)` (`int4_groups`, rows un-permuted) instead of the floats; one
    with `takes_blocks(hf_name, type_name, shape)` true gets `from_blocks(hf_name, rows, type_name)`, the
    tensor's raw bytes as uint8 [N, row bytes] (rows un-permuted)."""
    path = _check_path(path)
    with _MappedFile(path) as f:
        return _build(f, path, dtype, transform)


def _build(f: _MappedFile, path: Path, dtype: torch.dtype, transform=None) -> GGUFModel:
    header = f.header
    meta = header.metadata
    by_name = header.tensors
    config = _config_from_metadata(meta, {n: t.dims for n, t in by_name.items()}, path)

    # Which tensors to read, checked before any heavy work.
    wanted: dict[str, GGUFTensorInfo] = {}
    ignored: list[str] = []
    for name, t in by_name.items():
        target = hf_name(name)
        if target is None:
            if name != "rope_freqs.weight":
                ignored.append(name)
            continue
        wanted[target] = t
    expected = _expected(config)
    gguf_names = {h: g for g, h in _reverse_names(config).items()}
    for target in expected:
        if target not in wanted:
            raise ModelLoadError(f"{path}: missing tensor {gguf_names.get(target, target)} ({target})")
    extra = [t for t in wanted if t not in expected]
    if extra:
        raise ModelLoadError(
            f"{path}: unexpected tensors for a {config.num_layers}-layer model: {', '.join(sorted(extra)[:5])}"
        )
    for target, t in wanted.items():
        if t.type_name not in SUPPORTED_TENSOR_TYPES:
            raise UnsupportedModelError(
                f"{path}: tensor {t.name} has type {t.type_name}, which redwood cannot dequantize; "
                f"supported types: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )
        if t.shape != expected[target]:
            raise ModelLoadError(
                f"{path}: tensor {t.name} has shape {list(t.shape)}, but the metadata implies "
                f"{list(expected[target])}; the file is inconsistent or corrupt"
            )

    tensors: dict[str, torch.Tensor] = {}
    type_counts: dict[str, int] = {}
    permute = config.arch == "llama"
    # (dequantizing is the load's slow part, hence the progress bar)
    with Progress(total=sum(t.n_bytes for t in wanted.values()), desc=f"loading {path.name}", unit="B") as bar:
        for target, t in wanted.items():
            type_counts[t.type_name] = type_counts.get(t.type_name, 0) + 1
            heads = None
            if permute and (".q_proj." in target or ".k_proj." in target):
                heads = config.num_heads if ".q_proj." in target else config.num_kv_heads
            if len(t.shape) == 2 and getattr(transform, "takes_blocks", lambda name, type_name, shape: False)(
                target, t.type_name, t.shape
            ):
                # (the transform keeps the file's blocks: rows of raw bytes, no float tensor in between)
                rows = _as_bytes(f.raw(t)).view(t.shape[0], -1)
                tensors[target] = transform.from_blocks(
                    target, unpermute_qk(rows, heads) if heads else rows, t.type_name
                )
                del rows
            elif (
                t.type_name in INT4_GROUP_TYPES
                and len(t.shape) == 2
                and getattr(transform, "takes_int4_groups", lambda name, shape: False)(target, t.shape)
            ):
                # (the transform packs the file's 4-bit grid itself: no float tensor in between)
                groups = int4_groups(f.raw(t), t.type_name, t.shape)
                if heads:  # (whole rows move: each row's groups with it)
                    groups = tuple(unpermute_qk(g, heads) for g in groups)
                tensors[target] = transform.from_int4_groups(target, *groups)
                del groups
            else:
                w = dequantize(f.raw(t), t.type_name, t.shape, dtype)
                if heads:
                    w = unpermute_qk(w, heads)
                tensors[target] = w if transform is None else transform(target, w)
                del w
            f.release(t)
            bar.update(t.n_bytes)

    rope_freqs = None
    if "rope_freqs.weight" in by_name:
        t = by_name["rope_freqs.weight"]
        n = int(np.prod(t.dims))
        if n != config.head_dim // 2:
            raise ModelLoadError(
                f"{path}: rope_freqs.weight has {n} values, expected head_dim/2 = {config.head_dim // 2}"
            )
        if t.type_name not in ("F32", "F16", "BF16"):
            raise UnsupportedModelError(f"{path}: rope_freqs.weight has type {t.type_name}; expected F32, F16 or BF16")
        rope_freqs = dequantize(f.raw(t), t.type_name, (n,), torch.float32)

    metadata = dict(meta)
    metadata.update(
        {
            "path": str(path),
            "gguf_version": header.version,
            "architecture": config.arch,
            "name": meta.get("general.name"),
            "chat_template": meta.get("tokenizer.chat_template"),
            "bos_token_id": config.bos_token_id,
            "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
            "eos_token_ids": list(config.eos_token_ids),
            "tensor_types": type_counts,
            "ignored_tensors": ignored,
        }
    )
    return GGUFModel(config=config, tensors=tensors, metadata=metadata, path=path, rope_freqs=rope_freqs)


def _reverse_names(config: ModelConfig) -> dict[str, str]:
    """GGUF name -> HF name for every tensor a model of this config can have (for error messages)."""
    out = dict(_GLOBAL_NAMES)
    for i in range(config.num_layers):
        for g, h in _LAYER_NAMES.items():
            for kind in ("weight", "bias"):
                out[f"blk.{i}.{g}.{kind}"] = f"model.layers.{i}.{h}.{kind}"
    return out


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The model config a GGUF file's header implies (no tensor data read)."""
    path = _check_path(path)
    header = read_gguf_header(path)
    return _config_from_metadata(header.metadata, {n: t.dims for n, t in header.tensors.items()}, path)


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """The scalar and string metadata fields of a GGUF file (array fields such as the vocabulary left out)."""
    return dict(read_gguf_header(path).metadata)


def load_gguf_tokenizer(path: str | Path):
    """A transformers `PreTrainedTokenizerFast` built from the GGUF file's tokenizer metadata.

    The chat template comes from the file's `tokenizer.chat_template` field when there is one.
    `PreTrainedTokenizerFast.from_pretrained(..., gguf_file=...)` is used rather than `AutoTokenizer`: the
    latter first parses the whole file with `gguf.GGUFReader` to pick a model-specific class (several times
    slower for a Qwen2.5 vocabulary: docs/perf/cpu.md, "Figures cited from the source"), and the tokenizer
    it builds encodes identically.
    """
    path = _check_path(path)
    metadata = read_gguf_metadata(path)  # also reports a corrupt file clearly before transformers sees it
    if "tokenizer.ggml.model" not in metadata:
        raise ModelLoadError(f"{path} has no tokenizer in its metadata (no tokenizer.ggml.model field)")
    try:
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    except RedwoodError:
        raise
    except Exception as e:  # noqa: BLE001 -- any failure in transformers' GGUF tokenizer code
        raise ModelLoadError(f"cannot build a tokenizer from {path}: {type(e).__name__}: {e}") from e
    template = metadata.get("tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return tokenizer
