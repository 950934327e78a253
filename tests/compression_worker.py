"""One backward pass through a training script's own distribute(), under torchrun or horovodrun,
with each --grad-compression the script offers: rank 0 saves the averaged gradients of each, and
the average of the processes' gradient magnitudes, for tests/test_batch_scaling.py to compare.

    torchrun --standalone --nproc_per_node=2 tests/compression_worker.py distributed.py OUT.pt \
        none fp16 bf16
    horovodrun -np 2 -H localhost:2 python tests/compression_worker.py horovod_distributed.py \
        OUT.pt none fp16
"""

import importlib
import os
import sys
import tempfile

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(name, out, compressions):
    script = importlib.import_module(name[:-3])
    parser = script.build_parser()
    script.add_backend_args(parser)
    args = parser.parse_args(
        ["--dummy", "--image-size", "32", "-b", "8", "--output-dir", tempfile.mkdtemp()]
    )
    if hasattr(script, "hvd"):
        script.hvd.init()
        local_rank, rank, world_size = script.hvd.local_rank(), script.hvd.rank(), script.hvd.size()
    else:
        local_rank, rank, world_size = (
            int(os.environ[v]) for v in ("LOCAL_RANK", "RANK", "WORLD_SIZE")
        )
    device = script.set_device(local_rank)
    args = script.resolve_options(args, world_size, device, rank)
    script.init_distributed(args, rank, world_size, device)
    torch.manual_seed(100 + rank)  # each process its own shard of the batch
    images, target = (
        torch.randn(4, 3, 32, 32, device=device),
        torch.randint(0, 10, (4,), device=device),
    )

    def gradients(compression):
        torch.manual_seed(0)  # the same weights in every process
        model = script.create_model(args, 10).to(device)
        if compression is None:  # this process's own gradients, not averaged
            F.cross_entropy(model(images), target).backward()
            return {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        args.grad_compression = compression
        model, optimizer = script.distribute(
            model, script.build_optimizer(model, args, device), args, device
        )
        F.cross_entropy(model(images), target).backward()
        if hasattr(optimizer, "synchronize"):  # Horovod averages asynchronously until then
            optimizer.synchronize()
        return {
            n.replace("module.", ""): (g.full_tensor() if hasattr(g, "full_tensor") else g)
            .detach()
            .clone()
            for n, g in ((n, p.grad) for n, p in model.named_parameters())
        }

    magnitude = {n: script.all_reduce_sum(g.abs()) / world_size for n, g in gradients(None).items()}
    result = {"magnitude": magnitude, **{c: gradients(c) for c in compressions}}
    if rank == 0:
        torch.save(result, out)
    script.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])
