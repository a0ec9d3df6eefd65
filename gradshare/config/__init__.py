"""TrainConfig: SharedTrainer's options, flat and in groups, with their defaults and checks.

    config = TrainConfig(threshold=1e-3, epochs=5)     # raises ValueError / TypeError naming the option
    TrainConfig.batch_size                             # 32: the default, read by the CLI and gradshare.ml
    config.compression.density                         # a grouped option (gradshare/config/options.py)

This is the one place the everyday options' defaults and doc lines are written (each field's metadata),
and config/options.py the one place the grouped ones are: `SharedTrainer`'s signature takes each default from
here, docs/guide/options.md is `options_table()`, and the `gradshare.ml` Params and the CLI read them
from here too (tests/test_config.py, tests/docs/test_readme_options.py).

Validation runs once, in the groups' and TrainConfig's `__post_init__`, on the driver before any Spark
job: each group checks its own options, TrainConfig the ones that involve two (a numeric threshold with
the calibration's options, checkpoints with staleness or aggregated forwarding, ...). The fields keep the
options as given (MLflow logs those); the derived forms (`stopping`, the groups' `device_name`,
`checkpoint_root`, ...) are what the rest of gradshare works with. Module-level imports stay light (the
CLI imports this module to build its parser); checks that need torch or Numba import it when a config is made.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeAlias

from gradshare.checks import is_distributed
from gradshare.config.grouping import GROUPS
from gradshare.config.options import (
    Compression,
    Elastic,
    FaultTolerance,
    Network,
    Runtime,
    is_calibrated,
    is_number,
    option,
)
from gradshare.stopping import EarlyStopping, early_stopping_from
from gradshare.transport.protocol.wire import DEFAULT_PORT

if TYPE_CHECKING:
    import torch
    from pyspark import RDD
    from pyspark.sql import DataFrame

ModelSpec: TypeAlias = "torch.nn.Module | Callable[[], torch.nn.Module]"
LossFn: TypeAlias = "Callable[[torch.Tensor, torch.Tensor], torch.Tensor]"
# called with the model's trainable parameters; a factory typed for any iterable of tensors fits
OptimizerFactory: TypeAlias = "Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]"
TrainStep: TypeAlias = "Callable[[torch.nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]"
SchedulerFactory: TypeAlias = "Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]"
# a mean over the batch's rows, or (sum, count) summed as it is (docs/guide/validation.md)
Metric: TypeAlias = "Callable[[torch.Tensor, torch.Tensor], float | tuple[float, float]]"
# (X, y) arrays (X a tuple of arrays for several inputs), a DataFrame or an RDD of (features, label) rows
ValidationData: TypeAlias = "tuple[object, object] | DataFrame | RDD[tuple[object, object]]"


@dataclass(frozen=True)
class TrainConfig:
    """The everyday options, given flat to SharedTrainer; the others are in the four groups below and
    `elastic`. A group may also be given as a dict of its options (JSON: the Estimator's trainerOptions).

    TrainConfig checks them together. The fields are the options as given; the derived attributes below them are what
    the trainer uses.
    """

    loss: LossFn | None = option(
        None,
        "`(outputs, labels) -> tensor`; `None` chooses from the labels and one probe forward pass "
        "([Inputs, labels and losses](data.md#inputs-labels-and-losses))",
    )
    optimizer: OptimizerFactory | None = option(
        None,
        "a factory taking the parameter list; `None` is `Adam(lr=1e-3, fused=True)`. Its state stays on "
        "each worker (DL4J's design)",
    )
    train_step: TrainStep | None = option(
        None,
        "instead of `loss`, `fn(model, batch) -> loss tensor` for anything else "
        "([Inputs, labels and losses](data.md#inputs-labels-and-losses))",
    )
    threshold: float | Literal["auto"] = option(
        "auto",
        '`"auto"`: each worker derives τ before every step from a sample of residual + update, so '
        "each step sends `density` of the entries (`CalibratedThreshold`). A number: τ itself, meant for the "
        "optimizer's initial lr, moved by `compression.threshold_algorithm`",
    )
    port: int = option(DEFAULT_PORT, "UDP port of the relay on the driver (`0`: an ephemeral one)")
    batch_size: int = option(32, "rows per step per worker")
    epochs: int = option(1, "passes over each partition")
    num_workers: int | None = option(
        None, "barrier tasks; `None`: one per partition of the data, otherwise it is re-partitioned"
    )
    lr_scheduler: SchedulerFactory | None = option(
        None,
        "a factory `optimizer -> torch LR scheduler`, built and stepped alike on every worker "
        "(`runtime.scheduler_interval`); `ReduceLROnPlateau` is refused (each worker would step it on its own "
        "metric)",
    )
    validation_data: ValidationData | None = option(
        None,
        "`(X, y)` arrays: rank 0 scores `metric` after every epoch; or a DataFrame / RDD: one shard per "
        "worker, every worker scores its shard, the sums are reduced "
        "([Validation](validation.md#validation-split-across-the-workers))",
    )
    metric: Metric | None = option(
        None,
        "`(outputs, labels) -> float` (a mean over the rows) or `-> (sum, count)`; `None`: accuracy for "
        "class labels, else the loss",
    )
    early_stopping: dict[str, object] | EarlyStopping | None = option(
        None,
        '`dict(patience=0, min_delta=0.0, mode="min"\\|"max", monitor="val_metric"\\|"loss")`: '
        "rank 0 decides, every rank stops after the same epoch ([Early stopping](validation.md#early-stopping))",
    )
    seed: int = option(0, "the model factory's initialisation, each worker's shuffle and its torch RNG, per rank")
    verbose: int = option(1, "`0` quiet, `1` a progress bar fed by the relay and a line per finished epoch")
    elastic: Elastic | None = option(
        None,
        "`Elastic(min_workers, max_workers)`: the job shrinks when an executor is lost for good and "
        "grows at an epoch's end when slots are free ([Elastic fits](elastic.md))",
    )
    compression: Compression = option(Compression(), "how a step becomes shared messages: the groups below")
    network: Network = option(Network(), "the relay's sockets and forwarding")
    fault_tolerance: FaultTolerance = option(FaultTolerance(), "timeouts, lost workers, checkpoints")
    runtime: Runtime = option(Runtime(), "device, precision, data handling, callbacks, tracking")

    # derived by __post_init__ from the fields above
    stopping: EarlyStopping | None = field(init=False, repr=False, compare=False)  # early_stopping's rule

    @property
    def auto(self) -> bool:
        """τ is calibrated per step (threshold="auto") rather than given."""
        return self.threshold == "auto"

    @property
    def lr_factor(self) -> float:
        """What each worker's lr is multiplied by at every step (Compression.lr_factor)."""
        return self.compression.lr_factor(self.batch_size)

    def __post_init__(self) -> None:
        for keyword, group in GROUPS.items():
            if not isinstance(getattr(self, keyword), group):
                raise TypeError(
                    f"{keyword} must be gradshare.{group.__name__}(...), got {type(getattr(self, keyword)).__name__}"
                )
        self._check_threshold()
        self._check_numbers()
        self._check_callables()
        self._check_validation()

    def _check_threshold(self) -> None:
        threshold, algorithm = self.threshold, self.compression.threshold_algorithm
        if not self.auto and not (is_number(threshold) and 0 < threshold < math.inf):
            raise ValueError(f"threshold must be 'auto' or a positive finite number, got {threshold!r}")
        tuning = self.compression.tuning
        if not self.auto and tuning:
            raise ValueError(
                f"{', '.join(tuning)} tune threshold='auto'; with threshold={threshold!r} τ is given "
                "(drop them, or pass threshold='auto')"
            )
        calibrated = is_calibrated(algorithm)
        if self.auto and not (algorithm == "adaptive" or calibrated):
            raise ValueError(
                f"threshold='auto' calibrates τ itself; threshold_algorithm={algorithm!r} "
                "contradicts it (give a numeric threshold to use another rule, or pass a "
                "CalibratedThreshold)"
            )
        if calibrated and tuning:
            raise ValueError(
                f"{', '.join(tuning)} contradict the CalibratedThreshold given as threshold_algorithm "
                "(set them on that object)"
            )

    def _check_numbers(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {self.port!r}")
        for name, value in (("batch_size", self.batch_size), ("epochs", self.epochs)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_workers is not None and (not isinstance(self.num_workers, int) or self.num_workers < 1):
            raise ValueError(f"num_workers must be None or an int >= 1, got {self.num_workers!r}")
        elastic = self.elastic
        if elastic is not None:
            if not isinstance(elastic, Elastic):
                raise TypeError(
                    f"elastic must be gradshare.Elastic(min_workers=..., max_workers=...), got {type(elastic).__name__}"
                )
            if self.num_workers is not None and not elastic.min_workers <= self.num_workers <= elastic.max_workers:
                raise ValueError(
                    f"num_workers={self.num_workers} is outside elastic's range "
                    f"[{elastic.min_workers}, {elastic.max_workers}]"
                )
        if self.fault_tolerance.checkpoint_dir is not None:
            check_checkpoint_staleness("checkpoint_dir", self.compression.staleness)
            if self.network.forwarding == "aggregate":
                raise ValueError(
                    "forwarding='aggregate' cannot be checkpointed yet (the relay's aggregation "
                    "residual is not in the checkpoint); use forwarding='per-rank' or 'auto' with "
                    "checkpoint_dir"
                )

    def _check_callables(self) -> None:
        if self.lr_scheduler is not None and not callable(self.lr_scheduler):
            raise TypeError(
                "lr_scheduler must be a factory taking the optimizer, e.g. "
                "lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000); "
                f"got {type(self.lr_scheduler).__name__}"
            )
        if self.loss is not None and self.train_step is not None:
            raise ValueError("loss and train_step are exclusive: a train_step hook computes the loss itself")
        for name, value in (("loss", self.loss), ("train_step", self.train_step)):
            if value is not None and not callable(value):
                raise TypeError(f"{name} must be callable, got {type(value).__name__}")
        if self.optimizer is not None and not callable(self.optimizer):
            raise TypeError(
                "optimizer must be a factory taking the parameter list, e.g. lambda p: torch.optim.SGD(p, lr=0.1)"
            )

    def _check_validation(self) -> None:
        stopping = early_stopping_from(self.early_stopping)
        object.__setattr__(self, "stopping", stopping)  # frozen: __post_init__ fills the derived field
        if is_distributed(self.validation_data) and self.fault_tolerance.on_rank_loss == "continue":
            raise ValueError(
                "validation_data as a DataFrame or RDD needs every worker's shard scored; "
                "on_rank_loss='continue' would go on without one (use 'wait' or 'restart', or an "
                "in-memory (X, y) pair)"
            )
        if stopping is not None and stopping.monitor == "val_metric" and self.validation_data is None:
            raise ValueError(
                "early_stopping monitors 'val_metric' but no validation_data is given; "
                "pass validation_data or monitor='loss'"
            )


def check_checkpoint_staleness(argument: str, staleness: int) -> None:
    """Checkpoints (checkpoint_dir, or fit's resume_from) need staleness 0."""
    if staleness:
        raise ValueError(
            f"{argument} needs staleness=0 (an epoch's end is then a point every replica reaches "
            f"with the whole log applied); got staleness={staleness}"
        )


def options_table() -> str:
    """docs/guide/options.md's tables: SharedTrainer's flat options, then each group's, with default and doc
    line from the fields' metadata (tests/docs/test_readme_options.py keeps the page equal to this)."""
    parts = [_table("SharedTrainer(model, loss=None, optimizer=None, *, ...)", TrainConfig, model=True)]
    for keyword, group in (*GROUPS.items(), ("elastic", Elastic)):
        parts.append(_table(f"{keyword}={group.__name__}(...)", group, model=False))
    return "\n\n".join(parts) + "\n"


def _table(title: str, owner: type, model: bool) -> str:
    doc = " ".join((owner.__doc__ or "").split("\n\n")[0].split())
    rows = [f"### `{title}`", "", doc, "", "| option | default | meaning |", "|---|---|---|"]
    if model:
        rows.append(
            "| `model` | required | an `nn.Module`, or a zero-argument factory returning one (called on the "
            "driver after `torch.manual_seed(seed)`); every replica starts from the same parameters |"
        )
    for f in dataclasses.fields(owner):
        if not f.init:
            continue
        shown = f.metadata.get("shown") or (
            "required"
            if f.default is dataclasses.MISSING
            else f"`{type(f.default).__name__}()`"
            if dataclasses.is_dataclass(f.default)
            else f'`"{f.default}"`'
            if isinstance(f.default, str)
            else f"`{f.default!r}`"
        )
        rows.append(f"| `{f.name}` | {shown} | {f.metadata['doc']} |")
    return "\n".join(rows)
