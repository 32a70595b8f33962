"""The same tiny training run written for `accelerate launch`, unchanged under `prefect-accelerate launch`.

    prefect-accelerate launch --cpu --num_processes 2 examples/train_accelerate.py
"""

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    accelerator = Accelerator()
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(256, 8, generator=generator)
    targets = inputs.sum(dim=1, keepdim=True)
    loader = DataLoader(TensorDataset(inputs, targets), batch_size=16, shuffle=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(2):
        for batch, target in loader:
            loss = torch.nn.functional.mse_loss(model(batch), target)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        accelerator.print(f"epoch {epoch}  loss {loss.item():.4f}")
    state = accelerator.state
    print(f"process {state.process_index}/{state.num_processes} ({state.distributed_type}, {state.mixed_precision}) done", flush=True)
    accelerator.end_training()


if __name__ == "__main__":
    main()
