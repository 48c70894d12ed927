"""The arguments that ``gradpress train`` and ``compare`` share, and the :class:`~.config.TrainConfig` they
make."""
from __future__ import annotations

import argparse

from gradpress.testbed import arguments
from gradpress.testbed.training.checks import model_spec
from gradpress.testbed.training.config import TrainConfig
from gradpress.testbed.training.options import option, parse_options


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``gradpress train`` and ``compare``, each checked as it is parsed
    (:mod:`gradpress.testbed.arguments`, and :func:`~.checks.model_spec`,
    :func:`~.options.option`)."""
    from gradpress.testbed.data import dataset_names

    parser.add_argument("--model", type=model_spec, default="mlp",
                        help="model spec (gradpress.testbed.models), e.g. mlp-wide:width=8192")
    parser.add_argument("--data", default="fashion-mnist", choices=dataset_names(), help="dataset")
    parser.add_argument("--workers", type=arguments.positive_int, default=2,
                        help="local worker processes per node: the run has --nodes × --workers ranks")
    parser.add_argument("--nodes", type=arguments.positive_int, default=1,
                        help="emulated nodes, each of --workers processes with torchrun's variables "
                             "(LOCAL_WORLD_SIZE, LOCAL_RANK, GROUP_RANK, ...), so that --option "
                             "hierarchy=node makes a node of each")
    parser.add_argument("--bandwidth", type=arguments.rate,
                        help="emulate a star network with this rate per link (e.g. 100mbit, 1gbit; root): "
                             "with one node, a link per worker; with --nodes, a link per node, its workers "
                             "talking to each other inside it, unlimited")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=arguments.positive_int)
    length.add_argument("--steps", type=arguments.positive_int)
    parser.add_argument("--seconds", type=arguments.positive_float,
                        help="train for this much wall-clock (evaluation excluded), ending at the first "
                             "evaluation past it; with --steps or --epochs, whichever ends first")
    parser.add_argument("--batch-size", type=arguments.positive_int,
                        help="per-worker batch size (default: the model's)")
    parser.add_argument("--lr", type=arguments.positive_float, help="learning rate (default: the model's)")
    parser.add_argument("--seed", type=arguments.seed, default=0)
    parser.add_argument("--eval-every", type=arguments.positive_int,
                        help="evaluate every this many steps (default: each epoch)")
    parser.add_argument("--option", type=option, action="append", default=[], metavar="KEY=VALUE",
                        help="gradpress runtime option (feedback, min_numel, warmup_steps, mode, master, "
                             "...), or auto's (candidates, measure_with, settle_steps, ...: the auto run "
                             "alone), each key once; the seed and timeout are --seed and --timeout")
    parser.add_argument("--timeout", type=arguments.positive_float, default=300.0,
                        help="seconds before a stuck collective raises")
    parser.add_argument("--threads", type=arguments.positive_int, default=1, help="torch threads per worker")


def config_from_args(args: argparse.Namespace, compressor: str) -> TrainConfig:
    return TrainConfig(model=args.model, data=args.data, workers=args.workers, nodes=args.nodes,
                       compressor=compressor,
                       bandwidth=args.bandwidth, epochs=args.epochs, steps=args.steps, seconds=args.seconds,
                       batch_size=args.batch_size,
                       lr=args.lr, seed=args.seed, eval_every=args.eval_every,
                       options=parse_options(args.option), timeout=args.timeout, threads=args.threads)
