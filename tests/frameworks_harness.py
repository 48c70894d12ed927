"""One 2-process run that executes the README's and docs/integrations.md's multi-process examples and
the Lightning, Lightning Fabric, Accelerate, Hugging Face Trainer and no-op checks, sharing the
processes (importing torch, Lightning, Accelerate and Transformers costs seconds each).

Parent side: :func:`launch` starts this file as ``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu
--num_processes 2 …``, the invocation the README documents for 2 CPU processes (``torchrun`` where
Accelerate is missing), and returns every rank's results. Worker side: each job runs in its own folder
on its own rendezvous port (an example calls ``init_process_group`` itself; the launcher's own store
cannot host a second group) and the group is destroyed after it. The first failure ends the run: the
launcher then stops the other rank, and the jobs after it report that they did not run.

A job's result (per rank): ``{"ok": value}``, ``{"error": traceback}`` or ``{"skipped": reason}``.
"""
from __future__ import annotations

import contextlib
import functools
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

README = Path(__file__).resolve().parents[1] / "README.md"
INTEGRATIONS = Path(__file__).resolve().parents[1] / "docs" / "integrations.md"
MARKER = "<!-- run: 2 processes -->"
FRAMEWORKS = ("lightning", "accelerate", "transformers")  # an example importing one needs it installed


def readme_blocks(path: Path = README) -> list[str]:
    """The examples marked ``<!-- run: 2 processes -->`` in ``path`` (the README), in order."""
    return re.findall(re.escape(MARKER) + r"\s*```python\n(.*?)```", path.read_text(), flags=re.S)


def doc_blocks() -> list[str]:
    """docs/integrations.md's examples marked ``<!-- run: 2 processes -->``, in order."""
    return readme_blocks(INTEGRATIONS) if INTEGRATIONS.exists() else []


def framework_of(text: str) -> str | None:
    """The framework an example imports (None: plain torch and gradpress)."""
    return next((m for m in FRAMEWORKS if re.search(rf"^\s*(import|from) {m}\b", text, re.M)), None)


def job_names() -> list[str]:
    return ([f"readme{i}" for i in range(len(readme_blocks()))]
            + [f"docs{i}" for i in range(len(doc_blocks()))]
            + ["noop", "lightning", "accelerate", "fabric", "huggingface"])


# -- parent side ---------------------------------------------------------------------------------------
def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def launch(timeout: float = 300.0, jobs: list[str] | None = None) -> dict[str, Any]:
    """Run every job (or those named) on 2 ranks; ``{"ranks": [rank 0's results, rank 1's], "output":
    the run's output, "returncode": …, "command": …}``."""
    jobs = job_names() if jobs is None else jobs
    ports = _free_ports(len(jobs) + 1)
    out = Path(tempfile.mkdtemp(prefix="gradpress-frameworks-"))
    env = dict(os.environ, ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               GRADPRESS_HARNESS_OUT=str(out), GRADPRESS_HARNESS_JOBS=",".join(jobs),
               GRADPRESS_HARNESS_PORTS=",".join(map(str, ports[1:])))
    paths = [str(Path(__file__).parent), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(paths).rstrip(os.pathsep)
    try:
        import accelerate  # noqa: F401

        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                   "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", str(ports[0]), __file__]
    except ImportError:
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                   "--master-addr", "127.0.0.1", "--master-port", str(ports[0]), __file__]
    try:
        process = subprocess.Popen(command, env=env, cwd=out, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            output, _ = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the session this call started: launcher and workers
            output, _ = process.communicate()
            output += f"\n[harness] killed after {timeout} s"
        ranks = []
        for rank in range(2):
            path = out / f"rank{rank}.pt"
            ranks.append(torch.load(path, weights_only=False) if path.exists() else {})
        return {"ranks": ranks, "output": output, "returncode": process.returncode, "command": command}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def needs(module: str) -> None:
    """Skip the calling test where ``module`` is not installed (without importing it here: Lightning's
    import alone takes seconds)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed; `make test` installs it (the `test` extra)")


@functools.cache
def shared_run() -> dict[str, Any]:
    """:func:`launch`, once per test session (the README's tests and the framework tests share it)."""
    return launch()


def result(run: dict[str, Any], job: str) -> list[Any]:
    """Both ranks' ``ok`` values of ``job``; a job that failed, or did not run, fails the caller with
    the traceback and the run's output. A skipped job skips the caller."""
    import pytest

    values = []
    for rank, results in enumerate(run["ranks"]):
        entry = results.get(job)
        if entry is None:
            failed = [f"rank {r}: {name}" for r, res in enumerate(run["ranks"]) for name, e in res.items()
                      if "error" in e]
            pytest.fail(f"job {job} did not run on rank {rank} (failed before it: {failed or 'none'}; exit "
                        f"code {run['returncode']}).\nOutput (tail):\n{run['output'][-6000:]}")
        if "skipped" in entry:
            pytest.skip(entry["skipped"])
        if "error" in entry:
            pytest.fail(f"job {job} failed on rank {rank}:\n{entry['error']}\n"
                        f"Output (tail):\n{run['output'][-3000:]}")
        values.append(entry["ok"])
    return values


# -- worker side: the jobs -------------------------------------------------------------------------------
def _parameters(model: Any) -> dict[str, torch.Tensor]:
    for _ in range(3):
        model = getattr(model, "module", None) or getattr(model, "_orig_mod", None) or model
    def local(p: torch.Tensor) -> torch.Tensor:  # (FSDP's DTensors: this rank's part)
        return p.to_local() if hasattr(p, "to_local") else p

    return {name: local(p.detach()).cpu().clone() for name, p in model.named_parameters()}


def _sent_bytes(obj: Any) -> int:
    return int(obj.stats()["total"]["sent_bytes"])


def run_readme(index: int, text: str | None = None, source: str = "README") -> dict[str, Any]:
    """Execute README block ``index`` (or ``text``) as a script; what it leaves: the parameters of its
    model (``model``, a Lightning or Transformers ``trainer``'s module) and the bytes its gradpress
    state sent (``state``, ``comm``, a Lightning trainer's or a Fabric's strategy, a Trainer's
    GradpressCallback)."""
    scope: dict[str, Any] = {"__name__": "__main__"}
    printed = io.StringIO()
    text = readme_blocks()[index] if text is None else text
    with contextlib.redirect_stdout(printed):
        exec(compile(text, f"{source} 2-process block {index}", "exec"), scope)
    found: dict[str, Any] = {"printed": printed.getvalue()}
    trainer = scope.get("trainer")
    if trainer is not None and hasattr(trainer, "lightning_module"):
        found["parameters"] = _parameters(trainer.lightning_module)
        found["sent_bytes"] = _sent_bytes(trainer.strategy.gradpress_state)
    elif trainer is not None and hasattr(trainer, "callback_handler"):  # a transformers.Trainer
        found["parameters"] = _parameters(trainer.model)
        for callback in trainer.callback_handler.callbacks:
            if hasattr(getattr(callback, "state", None), "stats"):
                found["sent_bytes"] = _sent_bytes(callback.state)
    elif isinstance(scope.get("model"), torch.nn.Module):
        found["parameters"] = _parameters(scope["model"])
    fabric = scope.get("fabric")
    if getattr(getattr(fabric, "strategy", None), "gradpress_state", None) is not None:
        found["sent_bytes"] = _sent_bytes(fabric.strategy.gradpress_state)
    for name in ("state", "comm"):
        if hasattr(scope.get(name), "stats"):
            found["sent_bytes"] = _sent_bytes(scope[name])
    return found


SPEC = "topk:ratio=0.05"  # residual feedback: a wrong residual after resuming changes the parameters


def _batch(rank: int, step: int) -> torch.Tensor:
    """Data as a function of (rank, step) only: resuming replays exactly the batches of the
    uninterrupted run, whatever a framework does with a data loader's position."""
    return torch.randn(16, 16, generator=torch.Generator().manual_seed(1000 * rank + step))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.ReLU(), torch.nn.Linear(48, 4))


def _warnings_of(record: list) -> list[str]:
    return [str(w.message) for w in record if "gradpress" in str(w.message)]


def job_noop() -> dict[str, Any]:
    """Plain DDP: a state made for the model but never registered warns; a registered one and
    gradient accumulation under no_sync() do not."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradpress

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    found = {}
    for case in ("unregistered", "registered", "no_sync", "pair_no_sync"):
        model = DDP(_net())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        if case == "unregistered":
            state, _ = gradpress.ddp_comm_hook(SPEC, model=model.module)  # but no register_comm_hook
        elif case == "pair_no_sync":  # the pair registered by hand: the watch finds the DDP calling it
            state, hook = gradpress.ddp_comm_hook(SPEC, model=model.module)
            model.register_comm_hook(state, hook)
        else:
            state = gradpress.register(model, SPEC)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            for step in range(4):
                x = _batch(rank, step)
                accumulating = case.endswith("no_sync") and step < 3
                context = model.no_sync() if accumulating else contextlib.nullcontext()
                with context:
                    loss = torch.nn.functional.mse_loss(model(x), x[:, :4])
                    loss.backward()
                if not accumulating:
                    optimizer.step()
                    optimizer.zero_grad()
        found[case] = {"warnings": _warnings_of(record), "sent_bytes": _sent_bytes(state)}
    return found


def job_lightning() -> dict[str, Any]:
    """Lightning, 2 CPU processes: a run of 6 steps whose ModelCheckpoint writes at step 3, a run resumed
    from that checkpoint to step 6, and Lightning's stock DDPStrategy given the gradpress pair."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.strategies import DDPStrategy

    import gradpress
    from gradpress.lightning import GradpressStrategy

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x = _batch(self.global_rank, self.global_step)
            return torch.nn.functional.mse_loss(self.net(x), x[:, :4])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(64, 1)), batch_size=1)

    def trainer(strategy: Any, steps: int, callbacks: list | None = None, logger: Any = False) -> Any:
        return L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=logger,
                         callbacks=callbacks or [], enable_checkpointing=bool(callbacks),
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=3)

    whole = Net()  # (logging the figures must not change the training: the resumed run does not log them)
    run = trainer(GradpressStrategy(SPEC, seed=0, log_stats=True), 6,
                  [ModelCheckpoint(dirpath="ckpt", every_n_train_steps=3, save_top_k=-1)],
                  logger=CSVLogger("logs"))
    run.fit(whole, loader)
    logged = {name: float(value) for name, value in run.logged_metrics.items()
              if name.startswith("gradpress/")}
    path = "ckpt/epoch=0-step=3.ckpt"
    saved = torch.load(path, weights_only=False)["gradpress"]
    resumed = Net()
    again = trainer(GradpressStrategy(SPEC, seed=0), 6)
    again.fit(resumed, loader, ckpt_path=path)

    # the control: the same checkpoint without the gradpress state resumes differently (and warns)
    if again.global_rank == 0:
        checkpoint = torch.load(path, weights_only=False)
        del checkpoint["gradpress"]
        torch.save(checkpoint, "stripped.ckpt")
    torch.distributed.barrier()
    fresh = Net()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(GradpressStrategy(SPEC, seed=0), 6).fit(fresh, loader, ckpt_path="stripped.ckpt")
    fresh_warnings = _warnings_of(record)

    stock = Net()
    state, hook = gradpress.ddp_comm_hook(SPEC, model=stock)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer(DDPStrategy(ddp_comm_state=state, ddp_comm_hook=hook), 3).fit(stock, loader)
    return {"whole": _parameters(whole), "resumed": _parameters(resumed), "fresh": _parameters(fresh),
            "fresh_warnings": fresh_warnings,
            "sent_bytes": _sent_bytes(run.strategy.gradpress_state),
            "resumed_sent_bytes": _sent_bytes(again.strategy.gradpress_state),
            "saved_ranks": [part["rank"] for part in saved["ranks"]],
            "saved_steps": [part["steps"] for part in saved["ranks"]],
            "stock_warnings": _warnings_of(record), "stock_sent_bytes": _sent_bytes(state),
            "logged": logged, "flat": run.strategy.gradpress_state.stats(flat=True)}


def job_accelerate() -> dict[str, Any]:
    """Accelerate, 2 CPU processes: 6 steps with save_state at step 3, then a fresh Accelerator, model
    and optimizer that load_state and train steps 4 to 6."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    import gradpress.accelerate

    # the launcher's environment without ACCELERATE_USE_CPU: on a machine without GPUs Accelerate then
    # runs every process alone, and register says so instead of training each model on its own
    os.environ.pop("ACCELERATE_USE_CPU")
    try:
        alone = Accelerator()
        alone_type = str(alone.distributed_type)
        try:
            gradpress.accelerate.register(alone, alone.prepare(_net()), SPEC)
            alone_error = None
        except RuntimeError as error:
            alone_error = str(error)
    finally:
        os.environ["ACCELERATE_USE_CPU"] = "1"
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    def train(resume: bool) -> dict[str, Any]:
        accelerator = Accelerator()
        model = _net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = accelerator.prepare(model, optimizer)
        state = gradpress.accelerate.register(accelerator, model, SPEC, seed=0)
        start = 0
        if resume:
            accelerator.load_state("acc_ckpt")
            start = 3
        for step in range(start, 6):
            x = _batch(accelerator.process_index, step)
            loss = torch.nn.functional.mse_loss(model(x), x[:, :4])
            optimizer.zero_grad()
            accelerator.backward(loss)
            optimizer.step()
            if not resume and step == 2:
                accelerator.save_state("acc_ckpt")
        return {"parameters": _parameters(model), "sent_bytes": _sent_bytes(state),
                "processes": accelerator.num_processes, "distributed_type": str(accelerator.distributed_type)}

    whole = train(resume=False)
    resumed = train(resume=True)
    return {"whole": whole, "resumed": resumed, "alone_type": alone_type, "alone_error": alone_error}


def job_fabric() -> dict[str, Any]:
    """Lightning Fabric, 2 CPU processes: GradpressFabricStrategy trains 6 steps with fabric.save at step
    3; a fresh Fabric loads that checkpoint and trains steps 4 to 6; the control loads it stripped of its
    gradpress state; and Fabric's own "ddp" strategy with gradpress.register(the Fabric module) trains
    the 6 steps."""
    import lightning as L

    import gradpress
    from gradpress.lightning import GradpressFabricStrategy

    def setup(strategy: Any) -> tuple[Any, Any, Any]:
        fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
        fabric.launch()
        model = _net()
        return (fabric, *fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)))

    def train(fabric: Any, model: Any, optimizer: Any, start: int, stop: int) -> None:
        for step in range(start, stop):
            x = _batch(fabric.global_rank, step)
            loss = torch.nn.functional.mse_loss(model(x), x[:, :4])
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()

    fabric, model, optimizer = setup(GradpressFabricStrategy(SPEC, seed=0))
    train(fabric, model, optimizer, 0, 3)
    fabric.save("fabric.ckpt", {"model": model, "optimizer": optimizer, "step": 3})
    train(fabric, model, optimizer, 3, 6)
    whole, sent = _parameters(model), _sent_bytes(fabric.strategy.gradpress_state)
    saved = torch.load("fabric.ckpt", weights_only=False)["gradpress"]

    fabric, model, optimizer = setup(GradpressFabricStrategy(SPEC, seed=0))
    remainder = fabric.load("fabric.ckpt", {"model": model, "optimizer": optimizer})
    train(fabric, model, optimizer, remainder["step"], 6)
    resumed, resumed_sent = _parameters(model), _sent_bytes(fabric.strategy.gradpress_state)

    if fabric.global_rank == 0:  # the control: the same checkpoint without the gradpress state
        checkpoint = torch.load("fabric.ckpt", weights_only=False)
        del checkpoint["gradpress"]
        torch.save(checkpoint, "stripped.ckpt")
    fabric.barrier()
    fabric, model, optimizer = setup(GradpressFabricStrategy(SPEC, seed=0))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fabric.load("stripped.ckpt", {"model": model, "optimizer": optimizer})
    train(fabric, model, optimizer, 3, 6)
    fresh, fresh_warnings = _parameters(model), _warnings_of(record)

    fabric, model, optimizer = setup("ddp")
    state = gradpress.register(model, SPEC, seed=0)
    train(fabric, model, optimizer, 0, 6)
    return {"whole": whole, "resumed": resumed, "fresh": fresh, "plain": _parameters(model),
            "sent_bytes": sent, "resumed_sent_bytes": resumed_sent, "plain_sent_bytes": _sent_bytes(state),
            "fresh_warnings": fresh_warnings, "remainder_keys": sorted(remainder),
            "saved_ranks": [[part["rank"] for part in module["ranks"]] for module in saved],
            "repr": repr(state)}


def job_huggingface() -> dict[str, Any]:
    """Hugging Face Trainer, 2 CPU processes, GradpressCallback: 6 steps with a checkpoint at step 3, a
    Trainer resumed from it (train(resume_from_checkpoint=…)) to step 6, and the control: the same
    checkpoint without the gradpress files."""

    from transformers import Trainer, TrainingArguments

    from gradpress.huggingface import GradpressCallback

    class Net(torch.nn.Module):  # what Trainer trains: a module returning {"loss": …}
        def __init__(self) -> None:
            super().__init__()
            self.net = _net()

        def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.nn.functional.mse_loss(self.net(x), x[:, :4])}

    class Data(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"x": torch.randn(16, generator=torch.Generator().manual_seed(i))}

    def train(folder: str, resume: str | None = None) -> tuple[Any, GradpressCallback, list[str]]:
        args = TrainingArguments(output_dir=folder, max_steps=6, save_steps=3, per_device_train_batch_size=4,
                                 learning_rate=0.05, use_cpu=True, report_to=[], logging_steps=2, seed=0,
                                 disable_tqdm=True, ddp_find_unused_parameters=False)
        callback = GradpressCallback(SPEC, seed=0, log_stats=True)
        trainer = Trainer(model=Net(), args=args, train_dataset=Data(), callbacks=[callback])
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.train(resume_from_checkpoint=resume)
        return trainer, callback, _warnings_of(record)

    refused = []
    for spec, options in (("topk:ratio=2", {}), (SPEC, {"seed": -1}), (SPEC, {"bogus": 1})):
        try:
            GradpressCallback(spec, **options)
        except (TypeError, ValueError) as error:
            refused.append(f"{type(error).__name__}: {error}")
    trainer, callback, _ = train("hf")
    rank = trainer.args.process_index
    logged = [entry for entry in trainer.state.log_history if "gradpress/sent_bytes" in entry]
    whole = {"parameters": _parameters(trainer.model), "sent_bytes": _sent_bytes(callback.state),
             "files": sorted(os.listdir("hf/checkpoint-3")), "repr": repr(callback.state),
             "logged_steps": [entry["step"] for entry in logged],
             "logged_total": logged[-1]["gradpress/total/sent_bytes"] if logged else None}
    saved = torch.load(f"hf/checkpoint-3/gradpress_rank{rank}.pt", weights_only=True)
    trainer, callback, _ = train("hf", resume="hf/checkpoint-3")
    resumed = {"parameters": _parameters(trainer.model), "sent_bytes": _sent_bytes(callback.state)}

    if rank == 0:  # the control: the checkpoint without the gradpress files
        shutil.copytree("hf/checkpoint-3", "stripped/checkpoint-3")
        for r in range(trainer.args.world_size):
            os.remove(f"stripped/checkpoint-3/gradpress_rank{r}.pt")
    torch.distributed.barrier()
    trainer, callback, fresh_warnings = train("stripped", resume="stripped/checkpoint-3")
    return {"whole": whole, "resumed": resumed, "fresh": _parameters(trainer.model),
            "fresh_warnings": fresh_warnings, "saved_rank": saved["rank"], "saved_steps": saved["steps"],
            "refused": refused, "callback_repr": repr(GradpressCallback(SPEC, seed=0, log_stats=True))}


def _main() -> None:
    out = Path(os.environ["GRADPRESS_HARNESS_OUT"])
    jobs = os.environ["GRADPRESS_HARNESS_JOBS"].split(",")
    ports = os.environ["GRADPRESS_HARNESS_PORTS"].split(",")
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    # each job rendezvouses on a store of its own (rank 0 hosts it), not on the launcher's
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    results: dict[str, Any] = {}
    runners: dict[str, Callable[[], Any]] = {"noop": job_noop, "lightning": job_lightning,
                                              "accelerate": job_accelerate, "fabric": job_fabric,
                                              "huggingface": job_huggingface}
    needs = {"lightning": "lightning", "accelerate": "accelerate", "fabric": "lightning",
             "huggingface": "transformers"}
    blocks = readme_blocks()
    docs = doc_blocks()
    failed = False
    for job, port in zip(jobs, ports, strict=True):
        os.environ["MASTER_PORT"] = port
        folder = out / job
        folder.mkdir(exist_ok=True)
        os.chdir(folder)
        started = time.perf_counter()
        if job.startswith("readme"):
            text = blocks[int(job[len("readme"):])]
            module = framework_of(text)
            run = functools.partial(run_readme, int(job[len("readme"):]))
        elif job.startswith("docs"):
            text = docs[int(job[len("docs"):])]
            module = framework_of(text)
            run = functools.partial(run_readme, int(job[len("docs"):]), text, "docs/integrations.md")
        else:
            module, run = needs.get(job), runners[job]
        try:
            if module is not None:
                __import__(module)
        except ImportError as error:
            results[job] = {"skipped": f"{module} is not installed ({error}); `make test` installs it"}
            continue
        try:
            results[job] = {"ok": run(), "seconds": time.perf_counter() - started}
        except BaseException:  # noqa: BLE001 - reported to the parent
            results[job] = {"error": traceback.format_exc()}
            failed = True
        finally:
            import torch.distributed as dist

            if not failed and dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
            if "accelerate" in sys.modules:  # its process-wide singletons describe the group just destroyed
                from accelerate.state import AcceleratorState, GradientState

                AcceleratorState._reset_state(reset_partial_state=True)
                GradientState._reset_state()
        torch.save(results, out / f"rank{rank}.pt")
        print(f"[harness] rank {rank}: {job} {'failed' if failed else 'done'} in "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr, flush=True)
        if failed:
            sys.exit(1)  # the launcher stops the other rank
    torch.save(results, out / f"rank{rank}.pt")


if __name__ == "__main__":
    _main()
