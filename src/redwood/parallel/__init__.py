"""Tensor parallelism's processes on torch.distributed (gloo on the CPU, NCCL on CUDA): `group.TPGroup` (a rank's
collectives, each bounded by a timeout, and one clear `RankFailure` naming a rank that died) and `launch`
(joining torchrun's group, or spawning the ranks from this process). What is sharded and how lives with the model
(`redwood.models.shard`); how the engine runs on every rank lives with the engine (`redwood.engine.tp_worker`)."""

from redwood.parallel.group import TPGroup  # noqa: F401
