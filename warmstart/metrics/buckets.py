"""The buckets of ETT time and the span names that feed them: one table, in report order.

The calculator sums time per bucket, the report draws each bucket in its colour with its label, and
span writers (the recorder's callers, :class:`~warmstart.metrics.cache_spans.CacheSpans`) use the
names below. A span whose name is in no bucket's ``spans`` is its own bucket, shown after these.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class Bucket:
    """One bucket of a job's wall time."""

    name: str
    label: str
    """What the time was spent on, in words."""
    colour: str
    """Its colour in every chart: green is what we want more of, reds are losses."""
    spans: tuple[str, ...] = ()
    """Span names whose time lands here when the event names no ``bucket``."""


EFFECTIVE = "effective_training"
COMPILE = "compile"
SHARDING_PLAN = "sharding_plan"
#: From the OS starting the process to its interpreter being ready; recorded by the recorder itself.
PROCESS_LAUNCH = "process_launch"
#: The launch of a process that a preloader forked (the handover included): a span of its own in
#: the ``process_launch`` bucket, which names the attempt forked.
PRELOAD_HANDOVER = "preload_handover"
#: The job importing its libraries (torch, TorchRec, ...) before its first other span.
IMPORTS = "imports"
INIT_OTHER = "init_other"
CHECKPOINT_BLOCKING = "checkpoint_blocking"
LOST = "lost_progress"
RECOVERY = "recovery_wait"
SHUTDOWN = "shutdown"

#: Every report shows these buckets (0 when absent), in this order; buckets of other names follow.
BUCKETS: tuple[Bucket, ...] = (
    Bucket(EFFECTIVE, "training steps that count", "#2ca02c"),
    Bucket(COMPILE, "torch.compile compilation", "#1f77b4", (COMPILE,)),
    Bucket(SHARDING_PLAN, "sharding plan", "#9467bd", (SHARDING_PLAN,)),
    Bucket("process_group_init", "process group init", "#8c564b", ("process_group_init",)),
    Bucket("data_loader_init", "data loader init", "#e377c2", ("data_loader_init",)),
    Bucket("model_transform", "model build and transform", "#bcbd22", ("model_transform",)),
    Bucket("checkpoint_load", "checkpoint load", "#17becf", ("checkpoint_load",)),
    Bucket(PROCESS_LAUNCH, "process launch and interpreter start", "#5254a3", (PROCESS_LAUNCH,)),
    Bucket(IMPORTS, "importing the job's libraries", "#8ca252", (IMPORTS,)),
    Bucket(INIT_OTHER, "other start-up, before the first step", "#c7c7c7"),
    Bucket(CHECKPOINT_BLOCKING, "checkpoint saves blocking training", "#ff7f0e", ("checkpoint_save",)),
    Bucket("eval", "evaluation", "#aec7e8", ("eval",)),
    Bucket(LOST, "steps after the last committed checkpoint of a failed attempt", "#d62728"),
    Bucket(RECOVERY, "waiting to be rescheduled after a failure", "#ff9896"),
    Bucket(SHUTDOWN, "after train_end", "#7f7f7f"),
)
STANDARD_BUCKETS: tuple[str, ...] = tuple(b.name for b in BUCKETS)
KNOWN_SPANS: tuple[str, ...] = tuple(span for b in BUCKETS for span in b.spans)

#: A wait on the shared compile cache; written with an explicit bucket (the work it stands in for).
CACHE_FETCH = "cache_fetch"
#: A wait for another process that is compiling the same entry (single-flight); in the ``compile`` bucket.
CACHE_WAIT = "cache_wait"
#: The moment a background-compiled function or module starts running compiled (``WARMSTART_COMPILE=
#: background``): a span of no length, in the ``compile`` bucket, that the report's switch table reads.
COMPILE_SWITCH = "compile_switch"

_BY_NAME = {b.name: b for b in BUCKETS}
_SPAN_TO_BUCKET = {span: b.name for b in BUCKETS for span in b.spans}
_EXTRA_COLOURS = ("#98df8a", "#c5b0d5", "#c49c94", "#f7b6d2", "#dbdb8d", "#9edae5", "#ffbb78")


def span_bucket(span: str, bucket: str | None = None) -> str:
    """The bucket a span's time goes to: its ``bucket`` field, else its name, either mapped through
    the table (``checkpoint_save`` -> ``checkpoint_blocking``)."""
    name = bucket or span
    return _SPAN_TO_BUCKET.get(name, name)


def bucket_colour(name: str) -> str:
    """The chart colour of bucket ``name`` (stable for unknown names too)."""
    known = _BY_NAME.get(name)
    return known.colour if known else _EXTRA_COLOURS[sum(name.encode()) % len(_EXTRA_COLOURS)]


def bucket_label(name: str) -> str:
    """What bucket ``name`` holds, in words (a custom span's bucket: its name)."""
    known = _BY_NAME.get(name)
    return known.label if known else f"span {name}"
