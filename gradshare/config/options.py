"""SharedTrainer's option groups: each option written once, with its default, type, check and doc line.

    SharedTrainer(model, epochs=10, compression=Compression(density=1e-3),
                  network=Network(advertise_host="10.0.0.5"), fault_tolerance=FaultTolerance(checkpoint_dir=d))

The everyday options stay flat on SharedTrainer (config.TrainConfig); the rest live in four frozen
groups, in the manner of Lightning's ``strategy=DDPStrategy(...)`` and aioquic's ``QuicConfiguration``:
`Compression` (how a worker's step becomes the messages every replica applies: the τ rule, the density
schedule, the step rule's corrections), `Network` (the relay's sockets and forwarding), `FaultTolerance`
(timeouts, lost ranks, checkpoints) and `Runtime` (device, precision, data handling, callbacks,
tracking). `Elastic` is one more group, given flat (``elastic=Elastic(2, 8)``). Each field's metadata
holds its doc line; docs/guide/options.md is `config.options_table()` (tests/docs/test_readme_options.py), so the page,
the defaults and the checks cannot drift.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias, TypedDict, TypeGuard, TypeVar, cast, get_args

from gradshare.checks import check_mlflow_option, checkpoint_root
from gradshare.transport.protocol.tuning import RelayTuning
from gradshare.transport.protocol.wire import DEFAULT_BIND, DEFAULT_DATAGRAM_SIZE

if TYPE_CHECKING:
    import torch

    from gradshare.encoding import CalibratedThreshold

Aggregate: TypeAlias = Literal["sum", "mean"]
Forwarding: TypeAlias = Literal["per-rank", "aggregate", "auto"]
RelayPlace: TypeAlias = Literal["client", "in-job", "auto"]
OnRankLoss: TypeAlias = Literal["wait", "restart", "continue"]
SchedulerInterval: TypeAlias = Literal["step", "epoch"]
LrScaling: TypeAlias = Literal["sqrt", "linear"]
# the workers' optimizer momentum (replica/momentum.py): a number is the most each worker steps with
OptimizerMomentum: TypeAlias = Literal["auto", "off", "keep"] | float
Precision: TypeAlias = Literal["32", "bf16-mixed", "fp16-mixed"]
LabelDtype: TypeAlias = Literal["int64", "float32"]
WorkerOption: TypeAlias = Literal["profile", "direct_update", "tensor_state", "step_in_backward", "folded_view"]
EpochCallback: TypeAlias = Callable[[dict[str, object]], object]  # rank 0's history row -> stop?

FORWARDING: tuple[str, ...] = get_args(Forwarding)
# worker_options' keys: each a switch the worker reads (WorkerConfig.flag, task/config.py)
WORKER_OPTIONS: tuple[str, ...] = get_args(WorkerOption)

# threshold="auto"'s warm-up. 3 epochs, not 2: on the digits MLP with 2 workers (11 steps an epoch: 33
# warm-up steps instead of the floor's 24) the mean test accuracy of seeds 0-2 after epoch 2 went from 89.9
# to 90.4-90.7 % (DDP's 91.0 %), so it reaches 90 % in DDP's 2 epochs (docs/benchmarks/convergence.md).
DEFAULT_WARMUP_EPOCHS = 3.0
# ... and never fewer steps than this: with 4 workers on the digits MLP 2 epochs are only 12 steps (test
# accuracy 84 % after epoch 3; with 24 steps 91 %, DDP's 92 %). An explicit `warmup` is taken as given.
DEFAULT_WARMUP_MIN_STEPS = 24

_T = TypeVar("_T")


def option(default: _T, doc: str, shown: str | None = None) -> _T:
    """A group's field: its default, and the doc line (and, where the default is resolved later, how
    the options page shows it) that `config.options_table()` prints."""
    return field(default=default, metadata={"doc": doc, "shown": shown})


def required(doc: str) -> Any:
    """A group's field with no default, and its doc line."""
    return field(metadata={"doc": doc, "shown": None})


class ThresholdRule(Protocol):
    """What a threshold_algorithm object provides (encoding/threshold.py's rules)."""

    @property
    def threshold(self) -> float: ...

    def update(self, n_entries: int, n_params: int) -> float: ...


ThresholdAlgorithm: TypeAlias = "Literal['adaptive', 'fixed'] | ThresholdRule"


class WorkerFlags(TypedDict, total=False):
    """worker_options once checked: WORKER_OPTIONS' keys, each a switch the worker reads (WorkerConfig.flag)."""

    profile: bool
    direct_update: bool
    tensor_state: bool
    step_in_backward: bool
    folded_view: bool


def is_number(value: object) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_calibrated(rule: object) -> TypeGuard[CalibratedThreshold]:
    """Whether `rule` is a CalibratedThreshold (threshold="auto"'s rule, given as an object)."""
    from gradshare.encoding import CalibratedThreshold

    return isinstance(rule, CalibratedThreshold)


def _derive(group: object, name: str, value: object) -> None:
    object.__setattr__(group, name, value)  # the groups are frozen; __post_init__ fills their derived fields


@dataclass(frozen=True)
class Compression:
    """How a worker's step becomes the messages every replica applies (docs/guide/convergence.md).
    The defaults are measured (docs/guide/defaults.md); most of these exist for experiments."""

    threshold_algorithm: ThresholdAlgorithm = option(
        "adaptive",
        'with a numeric `threshold`: `"adaptive"` (DL4J\'s sparsity band), `"fixed"`, or a rule '
        'object; with `"auto"`, a `CalibratedThreshold` to tune',
    )
    density: float | None = option(
        None,
        '`"auto"` only: share of entries a step sends after the warm-up; a small model sends at least 768 '
        "entries a step (one datagram's worth)",
        "`None` (2e-3)",
    )
    warmup: float | None = option(
        None,
        '`"auto"` only: epochs over which the density falls geometrically from `warmup_density` to '
        "`density` (DGC's warm-up); `0` disables",
        "`None` (3 epochs, at least 24 steps)",
    )
    warmup_density: float | None = option(
        None, '`"auto"` only: the density at step 0 (the N workers share 0.2)', "`None` (0.2 ÷ N, at most 0.07)"
    )
    decay_from: float | None = option(
        None,
        '`"auto"` only: the density the run starts from, falling geometrically to `density` over the '
        "whole run while each worker's lr is × (density ÷ that density)^0.35; `0` disables; under a step cap "
        "the lr is not lowered",
        "`None` (by worker count: [defaults](defaults.md))",
    )
    step_cap: float | Literal["auto"] | None = option(
        "auto",
        "each parameter tensor's share of a step's summed messages is scaled down to at most this share "
        "of its norm as the step starts, on every replica alike ([convergence](convergence.md#step-cap)); "
        "`None` disables",
        '`"auto"` (by worker count: [defaults](defaults.md))',
    )
    residual_clip: float | None = option(5.0, "clip \\|residual\\| to this many τ every 5 steps; `None` disables")
    optimizer_momentum: OptimizerMomentum = option(
        "auto",
        '`"off"`: each worker steps with its optimizer\'s momentum off (its residual already averages '
        "its past updates; [convergence](convergence.md#the-workers-momentum)); a number in [0, 1): the most "
        'momentum each worker steps with; `"keep"`: as given',
        '`"auto"` (by worker count: [defaults](defaults.md))',
    )
    lr_batch_size: int | None = option(
        None,
        "the batch size the optimizer's lr was tuned at, when not `batch_size`: each worker's lr is × "
        "(batch_size ÷ lr_batch_size) ** 0.5 ([convergence](convergence.md#learning-rate-and-batch-size))",
    )
    lr_scaling: LrScaling = option(
        "sqrt",
        'the rule `lr_batch_size` applies: `"sqrt"` (Adam, Malladi et al. 2022) or `"linear"` (SGD, Goyal et al. 2017)',
    )
    follow_lr: bool = option(
        True,
        "when the lr changes from η to η′, each worker rescales its residual by η′/η and a numeric τ by "
        "η′/η₀ (corrected error feedback)",
    )
    local_view: bool = option(
        True,
        "each worker takes its gradient at the shared parameters plus its own unsent residual "
        "([convergence](convergence.md))",
    )
    aggregate: Aggregate = option(
        "sum", '`"sum"`: every replica adds every worker\'s ±τ (DL4J); `"mean"`: each message is applied × 1/N'
    )
    staleness: int = option(
        0, "k: before step t a worker has applied the log through t−1−k ([staleness](convergence.md#staleness))"
    )
    lookahead: bool = option(True, "with k ≥ 1, run each step at P + this worker's own unapplied messages")

    def __post_init__(self) -> None:
        algorithm = self.threshold_algorithm
        if isinstance(algorithm, str) and algorithm not in ("adaptive", "fixed"):
            raise ValueError(f"threshold_algorithm must be 'adaptive', 'fixed' or a rule object, got {algorithm!r}")
        if (
            not isinstance(algorithm, str)
            and not is_calibrated(algorithm)
            and not (hasattr(algorithm, "threshold") and hasattr(algorithm, "update"))
        ):
            raise TypeError("threshold_algorithm object must have .threshold and .update(n_entries, n_params)")
        warmup = self.warmup
        if warmup is not None and not (is_number(warmup) and 0 <= warmup < math.inf):
            raise ValueError(f"warmup must be a number of epochs >= 0, got {warmup!r}")
        if self.tuning and not is_calibrated(algorithm):
            from gradshare.encoding import CalibratedThreshold

            # density / warmup_density checked now (CalibratedThreshold's own messages), not on the executors
            defaults = CalibratedThreshold()
            CalibratedThreshold(
                density=defaults.density if self.density is None else self.density,
                warmup_density=defaults.warmup_density if self.warmup_density is None else self.warmup_density,
                decay_from=0.0 if self.decay_from is None else self.decay_from,
            )
        cap: object = self.step_cap  # the user's: checked here, whatever the annotation promises
        if cap not in ("auto", None) and not (is_number(cap) and 0 < cap < math.inf):
            raise ValueError(
                f"step_cap must be 'auto', None or a positive share of each tensor's norm (e.g. 0.1), got {cap!r}"
            )
        if self.residual_clip is not None and not self.residual_clip > 0:
            raise ValueError(f"residual_clip must be None or > 0, got {self.residual_clip!r}")
        momentum = self.optimizer_momentum
        if not (
            momentum in ("auto", "off", "keep")
            if isinstance(momentum, str)
            else is_number(momentum) and 0.0 <= momentum < 1.0
        ):
            raise ValueError(
                f"optimizer_momentum must be 'auto', 'off', 'keep' or a number in [0, 1) (the most "
                f"momentum each worker steps with), got {momentum!r}"
            )
        lr_batch = self.lr_batch_size
        if lr_batch is not None and (not isinstance(lr_batch, int) or isinstance(lr_batch, bool) or lr_batch < 1):
            raise ValueError(
                f"lr_batch_size must be None or an int >= 1 (the batch size the optimizer's lr was "
                f"tuned at), got {lr_batch!r}"
            )
        if self.lr_scaling not in get_args(LrScaling):
            raise ValueError(f"lr_scaling must be 'sqrt' or 'linear', got {self.lr_scaling!r}")
        if self.aggregate not in get_args(Aggregate):
            raise ValueError(f"aggregate must be 'sum' or 'mean', got {self.aggregate!r}")
        if not isinstance(self.staleness, int) or isinstance(self.staleness, bool) or self.staleness < 0:
            raise ValueError(f"staleness must be an int >= 0, got {self.staleness!r}")

    @property
    def tuning(self) -> dict[str, float]:
        """The options given that tune threshold="auto"'s calibration."""
        return {
            k: v
            for k, v in (
                ("density", self.density),
                ("warmup", self.warmup),
                ("warmup_density", self.warmup_density),
                ("decay_from", self.decay_from),
            )
            if v is not None
        }

    @property
    def warmup_epochs(self) -> float:
        return DEFAULT_WARMUP_EPOCHS if self.warmup is None else float(self.warmup)

    def lr_factor(self, batch_size: int) -> float:
        """What each worker's lr is multiplied by at every step: lr_batch_size's scaling, the ratio's square
        root for "sqrt" (Adam's rule, Malladi et al. 2022), the ratio for "linear" (SGD's, Goyal et al. 2017)."""
        if self.lr_batch_size is None:
            return 1.0
        ratio = batch_size / self.lr_batch_size
        return math.sqrt(ratio) if self.lr_scaling == "sqrt" else ratio


@dataclass(frozen=True)
class Network:
    """Where the relay listens and runs, and how it forwards ([Running on a cluster](cluster.md)). The
    relay's port is SharedTrainer's `port`."""

    bind: str = option(DEFAULT_BIND, "address the relay binds")
    advertise_host: str | None = option(
        None,
        "address the executors reach this process at; `None` is `spark.driver.host` (on Spark Connect "
        "`127.0.0.1` for a local master: [Spark Connect](connect.md))",
    )
    relay: RelayPlace = option(
        "auto",
        'where the relay runs: `"client"` (this process), `"in-job"` (rank 0\'s task), `"auto"`: '
        "in-job on Spark Connect ([Spark Connect](connect.md#where-the-relay-runs))",
    )
    forwarding: Forwarding = option(
        "auto",
        '`"per-rank"` forwards each worker\'s message to every other (N·(N−1) a step), `"aggregate"` '
        'one re-encoded sum to every worker (N a step), `"auto"` by worker count '
        "([aggregated forwarding](cluster.md#many-workers-aggregated-forwarding))",
    )
    datagram_size: int = option(
        DEFAULT_DATAGRAM_SIZE, "UDP datagram size in bytes, header and tag included (fits a 1500-byte MTU)"
    )
    spill_bytes: int = option(
        256 << 20,
        "a partition larger than this is kept in a local spill file and streamed in windows of this "
        "size ([data larger than memory](data.md#data-larger-than-memory))",
        "`268435456` (256 MiB)",
    )
    insecure: bool = option(False, "turn authentication and encryption off; exists only to measure their cost")

    def __post_init__(self) -> None:
        if self.relay not in get_args(RelayPlace):
            raise ValueError(f"relay must be one of {get_args(RelayPlace)}, got {self.relay!r}")
        if self.forwarding not in FORWARDING:
            raise ValueError(f"forwarding must be one of {FORWARDING}, got {self.forwarding!r}")


@dataclass(frozen=True)
class FaultTolerance:
    """What a slow, silent or lost worker costs, and the checkpoints a retried or resumed fit starts from
    ([Failures](failures.md), [Checkpoints](checkpoints.md))."""

    checkpoint_dir: str | None = option(
        None,
        "a directory the executors share, or any Hadoop-FS URI: every worker's state after every "
        "`checkpoint_every` epochs and the last; a retried stage restarts at the last one; "
        "`fit(resume_from=...)` continues from one ([Checkpoints](checkpoints.md))",
    )
    checkpoint_every: int = option(1, "epochs between checkpoints")
    timeout: float = option(
        60.0, "seconds any single wait (join, receive, snapshot) may take before an error naming what did not answer"
    )
    liveness_timeout: float = option(
        RelayTuning.liveness_timeout,
        "seconds of silence after which the relay *suspects* a worker ([Liveness](failures.md#liveness))",
    )
    on_rank_loss: OnRankLoss = option(
        "wait",
        'what a suspected worker costs: `"wait"` (the log waits, at most `timeout`), `"restart"` '
        '(the stage is retried at once) or `"continue"` (the log goes on without it; '
        "`result.skipped_steps` counts what was skipped)",
    )
    step_timeout: float = option(
        600.0, "seconds a worker may spend in one step before the fit stops with an error naming the rank and step"
    )

    # derived by __post_init__: checkpoint_dir as an absolute directory or URI
    checkpoint_root: str | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not (is_number(self.timeout) and self.timeout > 0) or not (
            is_number(self.liveness_timeout) and self.liveness_timeout > 0
        ):
            raise ValueError(
                f"timeout and liveness_timeout must be > 0, got {self.timeout!r}, {self.liveness_timeout!r}"
            )
        if not (is_number(self.step_timeout) and self.step_timeout > 0):
            raise ValueError(f"step_timeout must be a number of seconds > 0, got {self.step_timeout!r}")
        if self.on_rank_loss not in get_args(OnRankLoss):
            raise ValueError(f"on_rank_loss must be 'wait', 'restart' or 'continue', got {self.on_rank_loss!r}")
        every = self.checkpoint_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"checkpoint_every must be an int >= 1 (epochs), got {every!r}")
        root = None if self.checkpoint_dir is None else checkpoint_root(self.checkpoint_dir, "checkpoint_dir")
        _derive(self, "checkpoint_root", root)


@dataclass(frozen=True)
class Runtime:
    """Where and how each worker runs its steps, and what runs around them."""

    device: str | torch.device = option(
        "auto",
        '`"auto"`: the GPU Spark assigned to the task, else CUDA\'s device when torch has one, else the '
        'CPU; or `"cpu"`, `"cuda"`, `"cuda:N"` ([Devices](models.md#devices))',
    )
    precision: Precision = option(
        "32",
        '`"bf16-mixed"` / `"fp16-mixed"`: forward and loss under autocast, '
        "everything shared stays float32 ([Mixed precision](models.md#mixed-precision))",
    )
    scheduler_interval: SchedulerInterval = option(
        "step", '`"step"`: `lr_scheduler.step()` after every step; `"epoch"`: after every epoch'
    )
    label_dtype: LabelDtype | None = option(
        None, '`"int64"` / `"float32"` force class indices / regression targets; `None` infers them'
    )
    drop_last: bool | Literal["auto"] = option(
        "auto",
        "a partition's final short batch: dropped when it is one row and the model has BatchNorm "
        '(`"auto"`), always (`True`) or never (`False`)',
    )
    on_epoch_end: EpochCallback | Sequence[EpochCallback] | None = option(
        None, "a callable or list, `fn(row) -> stop?`, run on rank 0 after each epoch is scored; truthy asks for a stop"
    )
    mlflow: bool | dict[str, object] | None = option(
        None,
        '`True` or `{"experiment", "run_name", "tags", "log_model"}`: each fit is one MLflow run '
        "([Run logging](validation.md#run-logging-and-plots))",
    )
    worker_options: Mapping[str, bool] | None = option(
        None,
        '`{"profile": True}` per-phase step timers in worker reports; `{"direct_update": False}` the '
        'general update path; `{"tensor_state": True}` the device code path on the CPU (tests, benchmarks)',
    )

    # derived by __post_init__ from the fields above
    device_name: str = field(init=False, repr=False, compare=False)  # "auto" | "cpu" | "cuda" | "cuda:N"
    callbacks: tuple[EpochCallback, ...] = field(init=False, repr=False, compare=False)  # on_epoch_end's
    mlflow_config: dict[str, object] | None = field(init=False, repr=False, compare=False)  # None: off
    worker_flags: WorkerFlags = field(init=False, repr=False, compare=False)  # worker_options checked

    def __post_init__(self) -> None:
        _derive(self, "mlflow_config", check_mlflow_option(self.mlflow))
        if self.drop_last not in ("auto", True, False):
            raise ValueError(f"drop_last must be 'auto', True or False, got {self.drop_last!r}")
        # the defaults need no check, nor torch imported (the CLI reads them to build its parser)
        if self.precision != "32":
            from gradshare.replica.precision import check_precision

            check_precision(self.precision)
        device_name = "auto"
        if not (isinstance(self.device, str) and self.device == "auto"):
            from gradshare.replica.device import check_device

            device_name = check_device(self.device)
        _derive(self, "device_name", device_name)
        if self.scheduler_interval not in get_args(SchedulerInterval):
            raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {self.scheduler_interval!r}")
        if self.label_dtype not in (None, *get_args(LabelDtype)):
            raise ValueError(f"label_dtype must be None, 'int64' or 'float32', got {self.label_dtype!r}")
        _derive(self, "callbacks", _callbacks(self.on_epoch_end))
        _derive(self, "worker_flags", _worker_flags(self.worker_options))


@dataclass(frozen=True)
class Elastic:
    """An elastic fit (docs/guide/elastic.md): the job runs on between `min_workers` and `max_workers`
    workers and re-forms when the cluster changes. A rank whose executor is lost re-forms the job without
    it (once `slot_wait` s passed without its slot coming back); free slots at an epoch's end re-form it
    larger. Each re-form starts from the relay's parameters (nothing of the log is lost but the lost
    rank's step in flight) and runs the interrupted epoch again on the new partitioning, so no row of it
    is skipped."""

    min_workers: int = required(
        "the fewest workers the fit runs on; below it, it waits `timeout` s for slots, "
        "then stops with an error naming both numbers"
    )
    max_workers: int = required("the most workers it grows to")
    keep_global_batch: bool = option(
        False,
        "`False` keeps `batch_size` per worker (a step is the step the lr was tuned for); `True` rescales "
        "it to round(batch_size × start workers ÷ workers)",
    )
    slot_wait: float = option(
        30.0, "seconds a lost executor's slot may take to come back before the job re-forms without it"
    )
    max_reforms: int = option(
        8,
        "re-forms in one fit; one more (an executor that keeps being lost and coming "
        "back) stops the fit with an error naming the count",
    )

    def __post_init__(self) -> None:
        low, high = self.min_workers, self.max_workers
        for name, value in (("min_workers", low), ("max_workers", high), ("max_reforms", self.max_reforms)):
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "max_reforms" else 1):
                raise ValueError(
                    f"Elastic({name}=...) must be an int >= {0 if name == 'max_reforms' else 1}, got {value!r}"
                )
        if low > high:
            raise ValueError(f"Elastic(min_workers={low}, max_workers={high}): min_workers is above max_workers")
        if not (is_number(self.slot_wait) and 0 <= self.slot_wait < math.inf):
            raise ValueError(f"Elastic(slot_wait=...) must be a number of seconds >= 0, got {self.slot_wait!r}")
        if not isinstance(self.keep_global_batch, bool):
            raise ValueError(f"Elastic(keep_global_batch=...) must be True or False, got {self.keep_global_batch!r}")

    def batch_size(self, batch_size: int, start_world: int, world: int) -> int:
        """The per-worker batch at `world` workers of a fit that started at `start_world` with `batch_size`."""
        if not self.keep_global_batch:
            return batch_size
        return max(1, round(batch_size * start_world / world))


def _callbacks(option: EpochCallback | Sequence[EpochCallback] | None) -> tuple[EpochCallback, ...]:
    """`on_epoch_end`: None, one callable or a list of them."""
    if option is None:
        return ()
    found: tuple[object, ...] = tuple(option) if isinstance(option, (list, tuple)) else (option,)
    callbacks: list[EpochCallback] = []
    for i, f in enumerate(found):
        if not callable(f):
            raise ValueError(f"on_epoch_end[{i}] is {type(f).__name__}, not a callable (row) -> stop?")
        callbacks.append(f)
    return tuple(callbacks)


def _worker_flags(options: Mapping[str, bool] | None) -> WorkerFlags:
    flags = dict(options or {})
    unknown = sorted(set(flags) - set(WORKER_OPTIONS))
    if unknown:
        raise ValueError(f"worker_options has unknown key(s) {unknown}; known: {sorted(WORKER_OPTIONS)}")
    for key, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"worker_options[{key!r}] must be True or False, got {value!r}")
    # a dict's keys cannot narrow it to a TypedDict: they were checked against WORKER_OPTIONS just above
    return cast(WorkerFlags, flags)
