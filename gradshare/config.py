"""TrainConfig: every SharedTrainer option with its default and its checks, in one frozen dataclass.

    config = TrainConfig(threshold=1e-3, epochs=5)     # raises ValueError / TypeError naming the option
    TrainConfig.batch_size                             # 32: the default, read by the CLI and gradshare.ml

This is the one place the defaults are written: `SharedTrainer`'s signature takes each default from
here (so help() and the options table in docs/guide/options.md show the values), the `gradshare.ml` Params and the CLI read them
from here too, and tests/test_config.py checks that none of them drifts. The relay's port and datagram
size are the transport's constants (transport/protocol/wire.py).

Validation runs once, in `__post_init__`, on the driver before any Spark job, and derives the forms the
rest of gradshare works with (`stopping`, `callbacks`, `mlflow_config`, `device_name`,
`checkpoint_root`, `worker_flags`) while the fields keep the options as given: MLflow logs those.
Module-level imports stay light (the CLI imports this module to build its parser); the checks that need
torch or the encoding's Numba code import them inside `__post_init__`'s helpers, when a config is made.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol, TypeAlias, TypedDict, TypeGuard, cast, get_args

from gradshare.checks import check_mlflow_option, checkpoint_root, is_distributed
from gradshare.stopping import EarlyStopping, early_stopping_from
from gradshare.transport.protocol.tuning import RelayTuning
from gradshare.transport.protocol.wire import DEFAULT_BIND, DEFAULT_DATAGRAM_SIZE, DEFAULT_PORT

if TYPE_CHECKING:
    import torch
    from pyspark import RDD
    from pyspark.sql import DataFrame

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

FORWARDING: tuple[str, ...] = get_args(Forwarding)
# worker_options' keys: each is a bool field of WorkerConfig of the same name (SharedTrainer's docstring)
WORKER_OPTIONS: tuple[str, ...] = get_args(WorkerOption)


class WorkerFlags(TypedDict, total=False):
    """worker_options once checked: WORKER_OPTIONS' keys (tests/test_config.py), each WorkerConfig's bool
    field of that name, so the checker matches ``WorkerConfig(**flags)`` key by key."""

    profile: bool
    direct_update: bool
    tensor_state: bool
    step_in_backward: bool
    folded_view: bool

# threshold="auto" (the density's default is CalibratedThreshold's). 3 epochs, not 2: on the digits MLP with
# 2 workers (11 steps an epoch: 33 warm-up steps instead of the floor's 24) the mean test accuracy of seeds
# 0-2 after epoch 2 went from 89.9 to 90.4-90.7 % (DDP's 91.0 %), so it reaches 90 % in DDP's 2 epochs;
# with 4 workers the floor below decides (docs/benchmarks/convergence.md, lock-step studies).
DEFAULT_WARMUP_EPOCHS = 3.0
# ... and never fewer steps than this by default: the warm-up is for the first steps, where the model
# moves most, and with 4 workers on the digits MLP 2 epochs are only 12 steps (test accuracy 84 % after
# epoch 3; with 24 steps 91 %, DDP's 92 %: docs/benchmarks/convergence.md). An explicit `warmup` is taken as given.
DEFAULT_WARMUP_MIN_STEPS = 24

ModelSpec: TypeAlias = "torch.nn.Module | Callable[[], torch.nn.Module]"
LossFn: TypeAlias = "Callable[[torch.Tensor, torch.Tensor], torch.Tensor]"
# called with the model's trainable parameters; a factory typed for any iterable of tensors fits
OptimizerFactory: TypeAlias = "Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]"
TrainStep: TypeAlias = "Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]"
SchedulerFactory: TypeAlias = "Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]"
# a mean over the batch's rows, or (sum, count) summed as it is (SharedTrainer's docstring, validation_data)
Metric: TypeAlias = "Callable[[torch.Tensor, torch.Tensor], float | tuple[float, float]]"
EpochCallback: TypeAlias = Callable[[dict[str, object]], object]  # rank 0's history row -> stop?
# (X, y) arrays (X a tuple of arrays for several inputs), a DataFrame or an RDD of (features, label) rows
ValidationData: TypeAlias = "tuple[object, object] | DataFrame | RDD[tuple[object, object]]"


class ThresholdRule(Protocol):
    """What a threshold_algorithm object provides (encoding/threshold.py's rules)."""

    @property
    def threshold(self) -> float: ...

    def update(self, n_entries: int, n_params: int) -> float: ...


ThresholdAlgorithm: TypeAlias = "Literal['adaptive', 'fixed'] | ThresholdRule"


def lr_factor(batch_size: int, lr_batch_size: int | None, scaling: str = "sqrt") -> float:
    """The factor on a worker's lr for an lr tuned at `lr_batch_size` rows and run at `batch_size`:
    the ratio's square root for "sqrt" (Adam's rule, Malladi et al. 2022), the ratio for "linear"
    (SGD's, Goyal et al. 2017); 1 when lr_batch_size is None."""
    if lr_batch_size is None:
        return 1.0
    ratio = batch_size / lr_batch_size
    return math.sqrt(ratio) if scaling == "sqrt" else ratio


@dataclass(frozen=True)
class Elastic:
    """An elastic fit (docs/guide/elastic.md): the job runs on between `min_workers` and `max_workers`
    workers and re-forms when the cluster changes. A rank whose executor is lost re-forms the job without
    it (once `slot_wait` s passed without its slot coming back); free slots at an epoch's end re-form it
    larger. Each re-form starts from the relay's parameters (nothing of the log is lost but the lost
    rank's step in flight) and runs the interrupted epoch again on the new partitioning, so no row of it
    is skipped.

    keep_global_batch: False (default) keeps `batch_size` per worker, so that a step is the step the lr
    was tuned for and only the number of updates per step changes; True rescales it to
    round(batch_size × start workers ÷ workers), the global batch of the first re-formed job.
    max_reforms: re-forms in one fit; one more (an executor that keeps being lost and coming back) stops
    the fit with an error naming the count."""

    min_workers: int
    max_workers: int
    keep_global_batch: bool = False
    slot_wait: float = 30.0
    max_reforms: int = 8

    def __post_init__(self) -> None:
        low, high = self.min_workers, self.max_workers
        for name, value in (("min_workers", low), ("max_workers", high), ("max_reforms", self.max_reforms)):
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "max_reforms" else 1):
                raise ValueError(f"Elastic({name}=...) must be an int >= {0 if name == 'max_reforms' else 1}, "
                                 f"got {value!r}")
        if low > high:
            raise ValueError(f"Elastic(min_workers={low}, max_workers={high}): min_workers is above max_workers")
        if not (_is_number(self.slot_wait) and 0 <= self.slot_wait < math.inf):
            raise ValueError(f"Elastic(slot_wait=...) must be a number of seconds >= 0, got {self.slot_wait!r}")
        if not isinstance(self.keep_global_batch, bool):
            raise ValueError(f"Elastic(keep_global_batch=...) must be True or False, got {self.keep_global_batch!r}")

    def batch_size(self, batch_size: int, start_world: int, world: int) -> int:
        """The per-worker batch at `world` workers of a fit that started at `start_world` with `batch_size`."""
        if not self.keep_global_batch:
            return batch_size
        return max(1, round(batch_size * start_world / world))


@dataclass(frozen=True)
class TrainConfig:
    """SharedTrainer's options (its docstring says what each does), checked together.

    The fields are the options as given; the derived attributes below them are what the trainer uses.
    """

    loss: LossFn | None = None
    optimizer: OptimizerFactory | None = None  # None: trainer.default_optimizer, Adam(lr=1e-3, fused)
    train_step: TrainStep | None = None
    threshold: float | Literal["auto"] = "auto"
    port: int = DEFAULT_PORT
    bind: str = DEFAULT_BIND
    advertise_host: str | None = None
    relay: RelayPlace = "auto"  # "auto": in the job on a Spark Connect session, in this process on a classic one
    threshold_algorithm: ThresholdAlgorithm = "adaptive"
    batch_size: int = 32
    epochs: int = 1
    num_workers: int | None = None
    staleness: int = 0
    lookahead: bool = True
    residual_clip: float | None = 5.0
    seed: int = 0
    verbose: int = 1
    validation_data: ValidationData | None = None
    metric: Metric | None = None
    early_stopping: dict[str, object] | EarlyStopping | None = None
    on_epoch_end: EpochCallback | Sequence[EpochCallback] | None = None
    label_dtype: LabelDtype | None = None
    datagram_size: int = DEFAULT_DATAGRAM_SIZE
    timeout: float = 60.0
    liveness_timeout: float = RelayTuning.liveness_timeout
    on_rank_loss: OnRankLoss = "wait"
    step_timeout: float = 600.0
    spill_bytes: int = 256 << 20
    insecure: bool = False
    worker_options: Mapping[str, bool] | None = None
    density: float | None = None
    warmup: float | None = None  # None: DEFAULT_WARMUP_EPOCHS, and at least DEFAULT_WARMUP_MIN_STEPS steps
    warmup_density: float | None = None
    decay_from: float | None = None  # None: the planner's (driver/policy.py), 2e-2 from 32 workers, 0 (off) below
    step_cap: float | Literal["auto"] | None = "auto"  # "auto": 0.06 below 32 workers, 0.1 from 32 (driver/policy.py)
    lr_batch_size: int | None = None  # the batch the optimizer's lr was tuned at; None: batch_size (lr as given)
    lr_scaling: LrScaling = "sqrt"  # how each worker's lr follows batch_size ÷ lr_batch_size
    optimizer_momentum: OptimizerMomentum = "auto"  # "auto": β1 / momentum ≤ 0.5 below 32 workers, 0 from 32 (driver/policy.py)
    lr_scheduler: SchedulerFactory | None = None
    scheduler_interval: SchedulerInterval = "step"
    follow_lr: bool = True
    local_view: bool = True
    aggregate: Aggregate = "sum"
    forwarding: Forwarding = "auto"
    drop_last: bool | Literal["auto"] = "auto"
    precision: Precision = "32"
    device: str | torch.device = "auto"
    mlflow: bool | dict[str, object] | None = None
    checkpoint_dir: str | None = None
    checkpoint_every: int = 1
    elastic: Elastic | None = None

    # derived by __post_init__ from the fields above
    stopping: EarlyStopping | None = field(init=False, repr=False, compare=False)  # early_stopping's rule
    callbacks: tuple[EpochCallback, ...] = field(init=False, repr=False, compare=False)  # on_epoch_end's
    mlflow_config: dict[str, object] | None = field(init=False, repr=False, compare=False)  # None: off
    device_name: str = field(init=False, repr=False, compare=False)  # "auto" | "cpu" | "cuda" | "cuda:N"
    checkpoint_root: str | None = field(init=False, repr=False, compare=False)  # absolute dir or URI
    worker_flags: WorkerFlags = field(init=False, repr=False, compare=False)  # worker_options checked

    @property
    def auto(self) -> bool:
        """τ is calibrated per step (threshold="auto") rather than given."""
        return self.threshold == "auto"

    @property
    def lr_factor(self) -> float:
        """What each worker's lr is multiplied by at every step: lr_batch_size's scaling (`lr_factor`)."""
        return lr_factor(self.batch_size, self.lr_batch_size, self.lr_scaling)

    @property
    def warmup_epochs(self) -> float:
        return DEFAULT_WARMUP_EPOCHS if self.warmup is None else float(self.warmup)

    def __post_init__(self) -> None:
        # the same checks, messages and order as SharedTrainer.__init__ had (tests assert some of them)
        self._derive("mlflow_config", check_mlflow_option(self.mlflow))
        self._check_threshold()
        self._check_choices()
        self._check_numbers()
        self._check_callables()
        self._check_validation()
        self._derive("worker_flags", _worker_flags(self.worker_options))

    def _derive(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)  # the class is frozen; __post_init__ fills its derived fields

    def _check_threshold(self) -> None:
        threshold, algorithm = self.threshold, self.threshold_algorithm
        if not self.auto and not (isinstance(threshold, (int, float)) and not isinstance(threshold, bool)
                                  and threshold > 0 and math.isfinite(threshold)):
            raise ValueError(f"threshold must be 'auto' or a positive finite number, got {threshold!r}")
        tuning = {k: v for k, v in (("density", self.density), ("warmup", self.warmup),
                                    ("warmup_density", self.warmup_density), ("decay_from", self.decay_from))
                  if v is not None}
        if not self.auto and tuning:
            raise ValueError(f"{', '.join(tuning)} tune threshold='auto'; with threshold={threshold!r} τ is given "
                             "(drop them, or pass threshold='auto')")
        calibrated = is_calibrated(algorithm)
        if self.auto and not (algorithm == "adaptive" or calibrated):
            raise ValueError(f"threshold='auto' calibrates τ itself; threshold_algorithm={algorithm!r} "
                             "contradicts it (give a numeric threshold to use another rule, or pass a "
                             "CalibratedThreshold)")
        if calibrated and tuning:
            raise ValueError(f"{', '.join(tuning)} contradict the CalibratedThreshold given as threshold_algorithm "
                             "(set them on that object)")
        warmup = self.warmup
        if warmup is not None and not (isinstance(warmup, (int, float)) and 0 <= warmup < math.inf):
            raise ValueError(f"warmup must be a number of epochs >= 0, got {warmup!r}")
        if isinstance(algorithm, str) and algorithm not in ("adaptive", "fixed"):
            raise ValueError(f"threshold_algorithm must be 'adaptive', 'fixed' or a rule object, got {algorithm!r}")
        if not isinstance(algorithm, str) and not calibrated and not (
                hasattr(algorithm, "threshold") and hasattr(algorithm, "update")):
            raise TypeError("threshold_algorithm object must have .threshold and .update(n_entries, n_params)")
        if self.auto and not calibrated:
            from gradshare.encoding import CalibratedThreshold

            # density / warmup_density checked now (CalibratedThreshold's own messages), not on the executors
            defaults = CalibratedThreshold()
            CalibratedThreshold(density=defaults.density if self.density is None else self.density,
                                warmup_density=defaults.warmup_density if self.warmup_density is None
                                else self.warmup_density,
                                decay_from=0.0 if self.decay_from is None else self.decay_from)

    def _check_choices(self) -> None:
        from gradshare.replica.device import check_device
        from gradshare.replica.precision import check_precision

        if self.drop_last not in ("auto", True, False):
            raise ValueError(f"drop_last must be 'auto', True or False, got {self.drop_last!r}")
        check_precision(self.precision)
        self._derive("device_name", check_device(self.device))
        if self.aggregate not in get_args(Aggregate):
            raise ValueError(f"aggregate must be 'sum' or 'mean', got {self.aggregate!r}")
        if self.forwarding not in FORWARDING:
            raise ValueError(f"forwarding must be one of {FORWARDING}, got {self.forwarding!r}")
        if self.relay not in get_args(RelayPlace):
            raise ValueError(f"relay must be one of {get_args(RelayPlace)}, got {self.relay!r}")
        if self.forwarding == "aggregate" and self.checkpoint_dir is not None:
            raise ValueError("forwarding='aggregate' cannot be checkpointed yet (the relay's aggregation residual is "
                             "not in the checkpoint); use forwarding='per-rank' or 'auto' with checkpoint_dir")
        if self.lr_scaling not in get_args(LrScaling):
            raise ValueError(f"lr_scaling must be 'sqrt' or 'linear', got {self.lr_scaling!r}")
        momentum = self.optimizer_momentum
        if not (momentum in ("auto", "off", "keep") if isinstance(momentum, str) else
                isinstance(momentum, (int, float)) and not isinstance(momentum, bool) and 0.0 <= momentum < 1.0):
            raise ValueError(f"optimizer_momentum must be 'auto', 'off', 'keep' or a number in [0, 1) (the most "
                             f"momentum each worker steps with), got {momentum!r}")
        if self.scheduler_interval not in get_args(SchedulerInterval):
            raise ValueError(f"scheduler_interval must be 'step' or 'epoch', got {self.scheduler_interval!r}")
        if self.label_dtype not in (None, *get_args(LabelDtype)):
            raise ValueError(f"label_dtype must be None, 'int64' or 'float32', got {self.label_dtype!r}")
        if self.on_rank_loss not in get_args(OnRankLoss):
            raise ValueError(f"on_rank_loss must be 'wait', 'restart' or 'continue', got {self.on_rank_loss!r}")

    def _check_numbers(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {self.port!r}")
        for name, value in (("batch_size", self.batch_size), ("epochs", self.epochs)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        lr_batch = self.lr_batch_size
        if lr_batch is not None and (not isinstance(lr_batch, int) or isinstance(lr_batch, bool) or lr_batch < 1):
            raise ValueError(f"lr_batch_size must be None or an int >= 1 (the batch size the optimizer's lr was "
                             f"tuned at), got {lr_batch!r}")
        if self.num_workers is not None and (not isinstance(self.num_workers, int) or self.num_workers < 1):
            raise ValueError(f"num_workers must be None or an int >= 1, got {self.num_workers!r}")
        elastic = self.elastic
        if elastic is not None:
            if not isinstance(elastic, Elastic):
                raise TypeError(f"elastic must be gradshare.Elastic(min_workers=..., max_workers=...), got "
                                f"{type(elastic).__name__}")
            if self.num_workers is not None and not elastic.min_workers <= self.num_workers <= elastic.max_workers:
                raise ValueError(f"num_workers={self.num_workers} is outside elastic's range "
                                 f"[{elastic.min_workers}, {elastic.max_workers}]")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ValueError(f"staleness must be an int >= 0, got {self.staleness!r}")
        if self.residual_clip is not None and not self.residual_clip > 0:
            raise ValueError(f"residual_clip must be None or > 0, got {self.residual_clip!r}")
        if self.timeout <= 0 or self.liveness_timeout <= 0:
            raise ValueError(f"timeout and liveness_timeout must be > 0, got {self.timeout!r}, "
                             f"{self.liveness_timeout!r}")
        cap: object = self.step_cap  # the user's: checked here, whatever the annotation promises
        if cap not in ("auto", None) and not (isinstance(cap, (int, float)) and _is_number(cap)
                                              and 0 < cap < math.inf):
            raise ValueError(f"step_cap must be 'auto', None or a positive share of each tensor's initial norm "
                             f"(e.g. 0.1), got {cap!r}")
        if not (_is_number(self.step_timeout) and self.step_timeout > 0):
            raise ValueError(f"step_timeout must be a number of seconds > 0, got {self.step_timeout!r}")
        every = self.checkpoint_every
        if not isinstance(every, int) or isinstance(every, bool) or every < 1:
            raise ValueError(f"checkpoint_every must be an int >= 1 (epochs), got {every!r}")
        root = None
        if self.checkpoint_dir is not None:
            root = checkpoint_root(self.checkpoint_dir, "checkpoint_dir")
            check_checkpoint_staleness("checkpoint_dir", self.staleness)
        self._derive("checkpoint_root", root)

    def _check_callables(self) -> None:
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise TypeError("lr_scheduler must be a factory taking the optimizer, e.g. "
                            "lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000); "
                            f"got {type(self.lr_scheduler).__name__}")
        if self.loss is not None and self.train_step is not None:
            raise ValueError("loss and train_step are exclusive: a train_step hook computes the loss itself")
        for name, value in (("loss", self.loss), ("train_step", self.train_step)):
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        if self.optimizer is not None and not callable(self.optimizer):
            raise TypeError("optimizer must be a factory taking the parameter list, e.g. "
                            "lambda p: torch.optim.SGD(p, lr=0.1)")

    def _check_validation(self) -> None:
        stopping = early_stopping_from(self.early_stopping)
        self._derive("stopping", stopping)
        if is_distributed(self.validation_data) and self.on_rank_loss == "continue":
            raise ValueError("validation_data as a DataFrame or RDD needs every worker's shard scored; "
                             "on_rank_loss='continue' would go on without one (use 'wait' or 'restart', or an "
                             "in-memory (X, y) pair)")
        if stopping is not None and stopping.monitor == "val_metric" and self.validation_data is None:
            raise ValueError("early_stopping monitors 'val_metric' but no validation_data is given; "
                             "pass validation_data or monitor='loss'")
        self._derive("callbacks", _callbacks(self.on_epoch_end))


def check_checkpoint_staleness(argument: str, staleness: int) -> None:
    """Checkpoints (checkpoint_dir, or fit's resume_from) need staleness 0."""
    if staleness:
        raise ValueError(f"{argument} needs staleness=0 (an epoch's end is then a point every replica reaches "
                         f"with the whole log applied); got staleness={staleness}")


def is_calibrated(rule: object) -> TypeGuard[CalibratedThreshold]:
    """Whether `rule` is a CalibratedThreshold (threshold="auto"'s rule, given as an object)."""
    from gradshare.encoding import CalibratedThreshold

    return isinstance(rule, CalibratedThreshold)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


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
