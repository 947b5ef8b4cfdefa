"""A small ResNet-style network and one training step, for ``compare --model`` on CUDA.

The step is real work for the GPU (forward, backward, SGD update, in
channels_last with mixed precision), so the loaders are measured feeding a
model rather than an empty loop.
"""

from __future__ import annotations

import torch
from torch import nn


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + self.skip(x))


def resnet_small(classes: int = 1000) -> nn.Module:
    """A ResNet-18-shaped network (one block per stage instead of two)."""
    return nn.Sequential(
        nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
        _Block(64, 64, 1), _Block(64, 128, 2), _Block(128, 256, 2), _Block(256, 512, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, classes))


class ModelStep:
    """Call with a uint8 ``[B, 3, H, W]`` batch and labels: one SGD step on ``device``.

    Args:
        device: Where the model lives (``"cuda"`` in practice; CPU works, slowly).
    """

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self.model = resnet_small().to(self.device, memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.mean = torch.tensor([0.485, 0.456, 0.406], device=self.device).view(1, 3, 1, 1) * 255
        self.std = torch.tensor([0.229, 0.224, 0.225], device=self.device).view(1, 3, 1, 1) * 255
        self.steps = 0
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = True

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        x = images.to(self.device, non_blocking=True)
        y = labels.to(self.device, non_blocking=True).clamp_(0, 999)
        x = ((x.float() - self.mean) / self.std).contiguous(memory_format=torch.channels_last)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.device.type == "cuda"):
            loss = nn.functional.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.steps += 1

    def synchronize(self) -> None:
        """Wait for queued GPU work, so wall times include every step."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
