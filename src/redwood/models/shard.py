"""What rank r of N holds of a model under tensor parallelism (Megatron's split, as vLLM and gpt-fast do it):

| weight (HF name, [out, in]) | split | rank r holds |
|---|---|---|
| q_proj [Hq·D, H], its bias | column-parallel (output rows) | query heads [r·Hq/N, (r+1)·Hq/N) |
| k_proj, v_proj [Hkv·D, H], biases | column-parallel | Hkv ≥ N: KV heads [r·Hkv/N, (r+1)·Hkv/N); Hkv < N: the one KV head its query heads read (replicated on N/Hkv ranks) |
| o_proj [H, Hq·D] | row-parallel (input columns) | its query heads' columns; the bias on rank 0 only (the all-reduce adds it once) |
| gate_proj, up_proj [F, H] | column-parallel | rows [r·F/N, (r+1)·F/N) |
| down_proj [H, F] | row-parallel | those columns; the bias on rank 0 only |
| embed_tokens, lm_head [V, H] | vocab-parallel (rows) | rows [r·⌈V/N⌉, min((r+1)·⌈V/N⌉, V)) |
| norms | replicated | all |

So a layer needs two all-reduces (after o_proj, after down_proj), the embedding one (each token's row lives on
one rank; the others add zeros: exact) and the head an all-gather of the logits (every rank sees the whole
distribution: the sampler and the verifiers run unchanged). Rank r's query heads read exactly its KV heads
(GQA's head h reads KV head h // (Hq/Hkv)), so attention needs no communication and each rank's KV cache holds
its own KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from redwood.config import ModelConfig
from redwood.errors import ConfigError
from redwood.models.cpu_weights import INT4_GROUP  # (the gguf format's 4-bit groups along a row)


def check_shardable(config: ModelConfig, world: int) -> None:
    """A one-line ConfigError when `config` cannot split over `world` ranks."""
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
        raise ConfigError(f"tensor_parallel_size must be a positive integer, got {world!r}")
    if world == 1:
        return
    hq, hkv, f = config.num_heads, config.num_kv_heads, config.intermediate_size
    if hq % world:
        raise ConfigError(
            f"tensor_parallel_size {world} must divide the model's {hq} attention heads "
            f"(sizes that fit: {', '.join(str(n) for n in range(2, hq + 1) if hq % n == 0 and _kv_fits(hkv, n))})"
        )
    if not _kv_fits(hkv, world):
        raise ConfigError(
            f"tensor_parallel_size {world} and the model's {hkv} KV heads: one must divide the other "
            "(KV heads split over the ranks, or each replicated on several)"
        )
    if f % world:
        raise ConfigError(f"tensor_parallel_size {world} must divide the MLP width {f}")


def _kv_fits(hkv: int, world: int) -> bool:
    return hkv % world == 0 or world % hkv == 0


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world`'s piece of a model of `config` (the whole model's config)."""

    rank: int
    world: int
    config: ModelConfig

    def __post_init__(self) -> None:
        check_shardable(self.config, self.world)
        if not 0 <= self.rank < self.world:
            raise ConfigError(f"rank {self.rank} is not in a group of {self.world}")

    # ------------------------------------------------------------------ the ranges this rank holds
    @property
    def q_heads(self) -> tuple[int, int]:
        """(first query head, count)."""
        n = self.config.num_heads // self.world
        return self.rank * n, n

    @property
    def kv_heads(self) -> tuple[int, int]:
        """(first KV head, count): the KV heads this rank's query heads read."""
        first_q, _ = self.q_heads
        n = max(1, self.config.num_kv_heads // self.world)
        return first_q // self.config.group_size, n

    @property
    def ffn(self) -> tuple[int, int]:
        n = self.config.intermediate_size // self.world
        return self.rank * n, (self.rank + 1) * n

    @property
    def vocab_rows(self) -> int:
        """⌈V/N⌉: every rank's padded share of the vocabulary (the all-gather's piece)."""
        return -(-self.config.vocab_size // self.world)

    @property
    def vocab(self) -> tuple[int, int]:
        """[start, stop) of the vocabulary rows this rank holds (the last rank's may be shorter)."""
        n, v = self.vocab_rows, self.config.vocab_size
        return min(self.rank * n, v), min((self.rank + 1) * n, v)

    @property
    def local_config(self) -> ModelConfig:
        """The config of this rank's layers and KV cache: its heads and MLP width (vocabulary: the whole)."""
        return replace(
            self.config,
            num_heads=self.q_heads[1],
            num_kv_heads=self.kv_heads[1],
            intermediate_size=self.ffn[1] - self.ffn[0],
        )

    # ------------------------------------------------------------------ slicing weights (HF names)
    def slice_of(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, stop) of the HF-named tensor `name` (`model.` prefix or not) this rank holds; None: the
        whole tensor (replicated). A row-parallel bias on ranks > 0 is `zero_bias`, not a slice."""
        D = self.config.head_dim
        leaf = name.rsplit(".", 2)[-2:]  # ("q_proj", "weight")
        proj, kind = (leaf[0], leaf[1]) if len(leaf) == 2 else (leaf[0], "")
        if proj == "q_proj":
            first, n = self.q_heads
            return 0, first * D, (first + n) * D
        if proj in ("k_proj", "v_proj"):
            first, n = self.kv_heads
            return 0, first * D, (first + n) * D
        if proj == "o_proj" and kind == "weight":
            first, n = self.q_heads
            return 1, first * D, (first + n) * D
        if proj in ("gate_proj", "up_proj"):
            return (0, *self.ffn)
        if proj == "down_proj" and kind == "weight":
            return (1, *self.ffn)
        if proj in ("embed_tokens", "lm_head"):
            return (0, *self.vocab)
        return None

    def local_shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this rank's piece of the whole tensor `name` of `shape`."""
        where = self.slice_of(name)
        if where is None:
            return tuple(shape)
        dim, start, stop = where
        return tuple(stop - start if d == dim else n for d, n in enumerate(shape))

    def zero_bias(self, name: str) -> bool:
        """Whether `name` is a row-parallel layer's bias this rank holds as zeros (it is added once, on rank 0)."""
        return self.rank > 0 and name.endswith(("o_proj.bias", "down_proj.bias"))

    def take(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the whole tensor `name` (a new tensor: the whole one can be freed)."""
        if self.zero_bias(name):
            return torch.zeros_like(tensor)
        where = self.slice_of(name)
        if where is None:
            return tensor
        dim, start, stop = where
        return tensor.narrow(dim, start, stop - start).clone()


class ShardTransform:
    """`read_gguf`'s transform under tensor parallelism: each tensor cut to this rank's piece as it is read
    (`ShardPlan.take`), then handed to `pack` (a `cpu_weights.packer` transform; None: kept float).

    A packer that keeps the file's own blocks gets them cut, never dequantized: kquant's Q4_K / Q6_K rows of
    256-value super-blocks and Q8_0 / Q5_0 rows of 32-value blocks (uint8 [N, K / file block · block bytes]) and
    gguf's 4-bit groups of 32 (q [N, K], step and offset [N, K / 32]). Rows (column-parallel q / k / v, gate / up, the head) cut anywhere; columns
    (row-parallel o_proj / down_proj) on whole blocks only: kquant's are checked before loading
    (`loading._kquant_cut_misfit`), a 4-bit group tensor cut inside a group is dequantized and packed like the
    file's other types instead."""

    def __init__(self, plan: ShardPlan, pack=None):
        self.plan, self.pack = plan, pack

    def _columns(self, name: str) -> tuple[int, int] | None:
        where = self.plan.slice_of(name)
        return None if where is None or where[0] != 1 else (where[1], where[2])

    def takes_blocks(self, name: str, type_name: str, shape: tuple[int, int]) -> bool:
        from redwood.cpu_kernels import kquant

        takes = getattr(self.pack, "takes_blocks", None)
        cols = self._columns(name)
        block = kquant.FILE_BLOCK.get(type_name, kquant.BLOCK)
        if takes is None or (cols is not None and (cols[0] % block or cols[1] % block)):
            return False
        return takes(name, type_name, self.plan.local_shape(name, shape))

    def from_blocks(self, name: str, rows: torch.Tensor, type_name: str):
        from redwood.cpu_kernels import kquant

        where = self.plan.slice_of(name)
        if where is not None:
            dim, start, stop = where
            if dim == 0:
                rows = rows[start:stop]
            else:  # (whole file blocks: takes_blocks checked)
                block, per = kquant.FILE_BLOCK[type_name], kquant.file_block_bytes(type_name)
                rows = rows[:, start // block * per : stop // block * per]
        return self.pack.from_blocks(name, rows.contiguous(), type_name)

    def takes_int4_groups(self, name: str, shape: tuple[int, int]) -> bool:
        takes = getattr(self.pack, "takes_int4_groups", None)
        cols = self._columns(name)
        if takes is None or (cols is not None and (cols[0] % INT4_GROUP or cols[1] % INT4_GROUP)):
            return False
        return takes(name, self.plan.local_shape(name, shape))

    def from_int4_groups(self, name: str, q: torch.Tensor, step: torch.Tensor, offset: torch.Tensor):
        where = self.plan.slice_of(name)
        if where is not None:
            dim, start, stop = where
            q = q.narrow(dim, start, stop - start)
            if dim == 1:  # (whole groups: takes_int4_groups checked)
                start, stop = start // INT4_GROUP, stop // INT4_GROUP
            step, offset = (t.narrow(dim, start, stop - start) for t in (step, offset))
        return self.pack.from_int4_groups(name, q.contiguous(), step.contiguous(), offset.contiguous())

    def __call__(self, name: str, w: torch.Tensor):
        w = self.plan.take(name, w)
        return w if self.pack is None else self.pack(name, w)
