import torch_xla


def spawn(fn, args=(), nprocs=None, join=True, daemon=False, start_method="spawn"):
    torch_xla._record("xla_multiprocessing.spawn", args=list(args), nprocs=nprocs, start_method=start_method,
                      function=type(fn).__name__)
    torch_xla._run_all(fn, args, nprocs)
