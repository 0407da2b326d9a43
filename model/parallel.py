"""Tensor and expert parallelism across the processes of one torch.distributed group, as the
official inference splits the model: attention heads (and their query and output projections),
index heads, routed experts and the vocabulary (embedding and LM head) are divided among the
ranks; everything else is held whole by every rank.

`Parallel` is the rank layout, passed explicitly to `Decoder(..., parallel=...)`; the default is
one process, which is the unsplit model exactly. The shard arithmetic (which part of which
official tensor a rank holds) is here and only here, and so are the collectives: functional
collectives, which Dynamo and Inductor trace into the compiled step like any other op."""
from __future__ import annotations

import datetime
import re
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from model.config import ModelConfig

# A split tensor's rank blocks must fall on whole block-scale blocks of an FP8 weight.
FP8_BLOCK = 128

# Official tensors split along a dimension (rank r holds the r-th of world_size equal parts);
# the rest are held whole by every rank, but a routed expert's, which only its owner holds.
_SPLIT_DIMS = (
    (re.compile(r"(embed|head)\.weight"), 0),  # vocabulary-parallel
    (re.compile(r"layers\.\d+\.attn\.attn_sink"), 0),  # per head
    # column-parallel: heads (wq_b), groups of heads (wo_a), index heads (indexer wq_b, weights_proj)
    (re.compile(r"layers\.\d+\.attn\.(wq_b|wo_a|indexer\.wq_b|indexer\.weights_proj)\.(weight|scale)"), 0),
    (re.compile(r"layers\.\d+\.attn\.wo_b\.(weight|scale)"), 1),  # row-parallel: the groups' low-rank inputs
    (re.compile(r"layers\.\d+\.ffn\.experts\.(w1|w2|w3)\.(weight|scale)"), 0),  # the routed stack, by expert
)
_ONE_EXPERT = re.compile(r"layers\.\d+\.ffn\.experts\.(\d+)\.")


class Part(NamedTuple):
    """Rows [start, stop) of dimension `dim` of a tensor."""

    dim: int
    start: int
    stop: int


class ParallelError(RuntimeError):
    """A phase (loading, compiling, capturing) failed on some rank; raised on every rank."""

    def __init__(self, message: str, rank: int, error_type: str):
        super().__init__(message)
        self.rank = rank
        self.error_type = error_type


class ParallelValueError(ParallelError, ValueError):
    """As ParallelError, where the failing rank's error was a ValueError (bad input)."""


@dataclass(frozen=True)
class Parallel:
    """Which part of the model this process holds: rank `rank` of `world_size` processes of the
    process group `group_name` (its collectives run there). `control_group` is a gloo group of
    the same ranks on which the ranks agree on the outcome of a phase (`agree`); its timeout
    bounds how long a rank waits for the others there."""

    world_size: int = 1
    rank: int = 0
    group_name: str | None = None
    control_group: object = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"Parallel: rank must be in [0, world_size), got rank {self.rank} of {self.world_size}")
        if self.world_size > 1 and self.group_name is None:
            raise ValueError("Parallel: more than one rank needs a process group (use Parallel.from_process_group)")

    @classmethod
    def from_process_group(cls, group=None, timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> "Parallel":
        """The layout of this process in `group` (default: the whole world) of an initialised
        torch.distributed. Collective: every rank of the group must call it (it creates the gloo
        group the ranks agree on, with `timeout`)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError("Parallel.from_process_group needs torch.distributed initialised (e.g. started by torchrun)")
        group = group or dist.group.WORLD
        world_size, rank = dist.get_world_size(group), dist.get_rank(group)
        if world_size == 1:
            return cls()
        ranks = dist.get_process_group_ranks(group)
        control = dist.new_group(ranks, backend="gloo", timeout=timeout)
        return cls(world_size, rank, group.group_name, control)

    # -- the layout -------------------------------------------------------------------------
    def check(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming what does not divide among the ranks."""
        w = self.world_size
        if w == 1:
            return
        counts = {"n_heads": cfg.n_heads, "o_groups": cfg.o_groups, "index_n_heads": cfg.index_n_heads,
                  "n_routed_experts": cfg.n_routed_experts, "vocab_size": cfg.vocab_size}
        bad = [f"{name} = {value}" for name, value in counts.items() if value % w]
        if bad:
            raise ValueError(f"cannot split the model across {w} ranks: {', '.join(bad)} not divisible by {w}")
        if cfg.linear_format == "fp8":
            rows = {"wq_b's rows (n_heads * head_dim / ranks)": cfg.n_heads * cfg.head_dim // w,
                    "the indexer wq_b's rows (index_n_heads * index_head_dim / ranks)": cfg.index_n_heads * cfg.index_head_dim // w,
                    "wo_b's inputs (o_groups * o_lora_rank / ranks)": cfg.o_groups * cfg.o_lora_rank // w}
            ragged = [f"{name} = {value}" for name, value in rows.items() if value % FP8_BLOCK]
            if ragged:
                raise ValueError(
                    f"cannot split the FP8 weights across {w} ranks on their {FP8_BLOCK}-wide scale blocks: {', '.join(ragged)}"
                )

    def local(self, count: int) -> int:
        """This rank's share of `count` heads, groups, experts or vocabulary rows."""
        return count // self.world_size

    def first(self, count: int) -> int:
        """The first of this rank's share of `count`."""
        return self.rank * self.local(count)

    def split_dim(self, name: str) -> int | None:
        """The dimension official tensor `name` is split along, None where every rank holds it whole."""
        if self.world_size == 1:
            return None
        return next((dim for pattern, dim in _SPLIT_DIMS if pattern.fullmatch(name)), None)

    def part(self, name: str, full_shape: tuple[int, ...]) -> Part | None:
        """This rank's part of official tensor `name` of `full_shape` (None: all of it)."""
        dim = self.split_dim(name)
        if dim is None:
            return None
        size = full_shape[dim] // self.world_size
        return Part(dim, self.rank * size, (self.rank + 1) * size)

    def full_shape(self, name: str, local_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of official tensor `name` whose part this rank holds in `local_shape`."""
        dim = self.split_dim(name)
        if dim is None:
            return tuple(local_shape)
        return tuple(s * self.world_size if d == dim else s for d, s in enumerate(local_shape))

    def held_elsewhere(self, name: str, n_routed_experts: int) -> bool:
        """Whether `name` is a tensor of a routed expert another rank holds (this rank skips it)."""
        match = _ONE_EXPERT.match(name) if self.world_size > 1 else None
        if match is None:
            return False
        expert, per_rank = int(match.group(1)), self.local(n_routed_experts)
        return expert < n_routed_experts and expert // per_rank != self.rank

    # -- agreeing on the outcome of a phase ---------------------------------------------------
    def agree(self, phase: str, error: BaseException | None = None) -> None:
        """Every rank calls this after `phase` with its error (None: it succeeded). If any rank
        failed, every rank raises a ParallelError (a ValueError where the failing rank's was)
        naming the first failing rank and its message, so that none is left waiting in a
        collective for a rank that gave up. One process: re-raises `error`."""
        if self.world_size == 1:
            if error is not None:
                raise error
            return
        import torch.distributed as dist

        mine = None if error is None else (phase, type(error).__name__, isinstance(error, ValueError), str(error))
        outcomes: list = [None] * self.world_size
        dist.all_gather_object(outcomes, mine, group=self.control_group)
        failed = [(rank, outcome) for rank, outcome in enumerate(outcomes) if outcome is not None]
        if not failed:
            return
        rank, (its_phase, error_type, is_value_error, message) = failed[0]  # every rank names the same
        others = f" (and on ranks {[r for r, _ in failed[1:]]})" if len(failed) > 1 else ""
        text = f"{its_phase} failed on rank {rank} of {self.world_size}{others}: {error_type}: {message}"
        raise (ParallelValueError if is_value_error else ParallelError)(text, rank, error_type) from error

    def agreed(self, phase: str, fn):
        """fn() on every rank, then `agree` on its outcome: fn's result where every rank's
        succeeded, else every rank raises the first failing rank's error."""
        try:
            result = fn()
        except Exception as error:  # noqa: BLE001 - every rank raises it, after agreeing
            self.agree(phase, error)
            raise  # not reached: agree raises
        self.agree(phase)
        return result

    @staticmethod
    def agreed_error(error: BaseException | None) -> "ParallelError | None":
        """The outcome of `agree` that `error` is or was raised from, else None."""
        return agreed_error(error)


def agreed_error(error: BaseException | None) -> ParallelError | None:
    """The outcome of `Parallel.agree` that `error` is or was raised from (e.g. by a compiler
    that wrapped it), else None: every rank raises it, so none must agree on it again."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, ParallelError):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


# -- the collectives of the decode step: functional, so that Dynamo and Inductor trace them -----
def all_reduce(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """The sum of `x` over the ranks (x itself for one process)."""
    if parallel.world_size == 1:
        return x
    from torch.distributed import _functional_collectives as funcol

    return funcol.all_reduce(x, "sum", parallel.group_name)


def all_gather_last(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """The ranks' `x` concatenated along the last dimension, rank 0 first."""
    if parallel.world_size == 1:
        return x
    from torch.distributed import _functional_collectives as funcol

    # all_gather_single replaces all_gather_tensor (same arguments) where it exists.
    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return gather(x.contiguous(), x.dim() - 1, parallel.group_name)


ONE_PROCESS = Parallel()
