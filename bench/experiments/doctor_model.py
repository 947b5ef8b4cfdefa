"""A small CPU network for bench/experiments/doctor_series.py: its step and the loader
compete for the same cores (torch on every core, the loader beside it)."""
import torch

torch.manual_seed(0)
net = torch.nn.Sequential(
    torch.nn.Conv2d(3, 16, 3, stride=2), torch.nn.ReLU(),
    torch.nn.Conv2d(16, 32, 3, stride=2), torch.nn.ReLU(),
    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10))
opt = torch.optim.SGD(net.parameters(), lr=0.01)


def train_step(images, labels):
    x = images.float().div_(255)
    loss = torch.nn.functional.cross_entropy(net(x), labels % 10)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss
