"""What both trainers (train_lora.py, train_omnivoice.py) share and no model file needs: torchrun's
processes, a subcommand run with its process group left after it, and the lists their messages name."""
import importlib
import os

import torch


def short_list(items: list, n=5) -> str:
    """The first n items of a list a message names, and how many more."""
    return ", ".join(map(str, items[:n])) + (f" and {len(items) - n} more" if len(items) > n else "")


def join_processes(device: torch.device) -> tuple:
    """-> (rank, processes, device). Under torchrun (RANK set): NCCL on cuda:LOCAL_RANK, or gloo on CPU (the
    trainers' several processes)."""
    import torch.distributed as dist
    if "RANK" not in os.environ:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # dynamo imports torch.distributed.nn.functional, whose 10 `group=group.WORLD` defaults would keep a
        # group made before it (and gloo's threads) past destroy_process_group, into the teardown: an abort
        importlib.import_module("torch._dynamo")
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.get_rank(), dist.get_world_size(), device


def run_command(commands: dict, args):
    """A trainer's subcommand, commands[args.command](args); the process group `join_processes` made is left
    afterwards, also when the command fails."""
    import torch.distributed as dist
    try:
        commands[args.command](args)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
