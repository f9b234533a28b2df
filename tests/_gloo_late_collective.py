"""torch's abort at exit without Lightning or shardplus (docs/limitations.md, "at exit"): ``python
tests/_gloo_late_collective.py MODE`` starts 2 gloo processes; rank 0 starts an async all-reduce of a tensor with
Python state, drops the tensor and the work, and exits; rank 1 joins the all-reduce only once rank 0 ran its last
``atexit`` handler, so that rank 0's gloo worker finishes it while the interpreter finalizes. Rank 0's exit status
is the script's (134: "terminate called without an active exception"). MODE ``none``: no teardown at exit, the
default group; ``mesh``: ``destroy_process_group`` registered at exit (as shardplus does on torch 2.13 and newer) and
the all-reduce on a device mesh's group, which the mesh keeps alive."""

import atexit
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

mode, rank = sys.argv[1], int(os.environ.get("RANK", "0"))
if rank == 0:
    flag = os.path.join(tempfile.mkdtemp(), "finalizing")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(20000 + os.getpid() % 20000), FLAG=flag)
    atexit.register(lambda: open(flag, "w").close())  # registered first, run last: the interpreter finalizes next
    subprocess.Popen([sys.executable, *sys.argv], env=dict(os.environ, RANK="1"))
dist.init_process_group("gloo", rank=rank, world_size=2)
if mode == "mesh":
    atexit.register(dist.destroy_process_group)
group = init_device_mesh("cpu", (2,)).get_group() if mode == "mesh" else None
if rank == 1:
    while not os.path.exists(os.environ["FLAG"]):  # (a demonstration: rank 0 can answer no collective by now)
        time.sleep(0.01)
    dist.all_reduce(torch.ones(1000), group=group)
else:
    tensor = torch.ones(1000)
    tensor.note = "Python state"  # the tensor's Python object outlives the Python reference
    dist.all_reduce(tensor, group=group, async_op=True)
    del tensor
