"""The cost model of a training step, a library piece that ``auto`` and the testbed's ``advise`` share.

:mod:`~gradpress.costmodel.network` prices collectives on a link (Hockney's α–β model, the strategies'
costs, token buckets, fits of α and β to measured exchanges); :mod:`~gradpress.costmodel.profile` holds a
step's compute and DDP's buckets; :mod:`~gradpress.costmodel.method` a method's measured compression and
wire costs per bucket; :mod:`~gradpress.costmodel.nodes` prices an exchange on N nodes of k ranks, flat or
in two levels; :mod:`~gradpress.costmodel.predict` puts them together into a predicted step;
:mod:`~gradpress.costmodel.levels` prices a step whose buckets each run their own method and level;
:mod:`~gradpress.costmodel.quality` turns a method's measured compression error into a factor on the
steps to a quality target.
Every name is importable from the package.
"""
from gradpress.costmodel.levels import level_steps, predict_levels, priced_steps
from gradpress.costmodel.method import (
    BASELINE,
    BucketCost,
    LocalStep,
    MethodCost,
    Transfer,
    baseline_cost,
    link_phases,
    measure_method,
    measure_with_errors,
    transfers_of,
)
from gradpress.costmodel.network import (
    DEFAULT_LATENCY,
    STRATEGIES,
    TWO_WAY,
    Breakdown,
    BucketStep,
    Cost,
    Observation,
    Phase,
    bandwidth_crossing,
    communication_cost,
    communication_time,
    crossover_bandwidth,
    fit_alpha_beta,
    fit_efficiency,
    fit_latency,
    fit_link,
    predict_bucketed_step,
    predict_step_time,
    rate_bits_per_second,
    refill,
    steady_tokens,
    transfer_seconds,
)
from gradpress.costmodel.nodes import (
    DEFAULT_INTRA_BANDWIDTH,
    FLAT,
    LevelCost,
    NodeExchange,
    Topology,
    flat_cost,
    level_costs,
    node_exchange,
    node_link_bytes,
    node_transfer_seconds,
    shard_phases,
)
from gradpress.costmodel.predict import calibrated, predict
from gradpress.costmodel.profile import FIRST_BUCKET_BYTES, Bucket, ComputeProfile, assign_buckets
from gradpress.costmodel.quality import (
    MIN_DELTA,
    CompressionError,
    compression_errors,
    runs_unbiased,
    signal_fraction,
    signal_fraction_of_mean,
    steps_factor,
    variance_factor,
)

__all__ = [
    "BASELINE", "DEFAULT_INTRA_BANDWIDTH", "DEFAULT_LATENCY", "FIRST_BUCKET_BYTES", "FLAT", "STRATEGIES",
    "TWO_WAY", "Breakdown", "Bucket", "BucketCost", "BucketStep", "ComputeProfile", "Cost", "LevelCost",
    "LocalStep", "MethodCost", "NodeExchange", "Observation", "Phase", "Topology", "Transfer",
    "assign_buckets", "bandwidth_crossing", "baseline_cost", "calibrated", "communication_cost",
    "communication_time", "crossover_bandwidth", "fit_alpha_beta", "fit_efficiency", "fit_latency", "fit_link",
    "flat_cost", "level_costs", "link_phases", "measure_method", "measure_with_errors", "node_exchange",
    "node_link_bytes",
    "node_transfer_seconds", "predict", "predict_bucketed_step", "predict_step_time", "rate_bits_per_second",
    "refill", "shard_phases", "steady_tokens", "transfer_seconds", "transfers_of",
    "MIN_DELTA", "CompressionError", "compression_errors", "runs_unbiased", "signal_fraction",
    "signal_fraction_of_mean", "steps_factor", "variance_factor",
    "level_steps", "predict_levels", "priced_steps",
]
