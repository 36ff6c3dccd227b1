"""tests/device_emulation.py: the CPU stand-in for a second device blames what a GPU would refuse
and lets through what a GPU takes."""
import pytest
import torch

from tests.device_emulation import DeviceMixError, EmulatedDevice

DEVICE = "cpu"  # the device under test, as a GPU test names it on a machine without one


def test_a_host_tensor_meeting_a_placed_one_is_refused():
    """The first H200 run's test_append_kv failure, on the CPU: lengths on the device plus a host
    arange."""
    with EmulatedDevice():
        lens = torch.tensor([0, 5, 40]).to(DEVICE)
        with pytest.raises(DeviceMixError, match=r"add: .* host tensor\(s\) of shape \(1, 9\)"):
            lens.long()[:, None] + torch.arange(9)[None]
        assert (lens.long()[:, None] + torch.arange(9, device=DEVICE)[None]).shape == (3, 9)


def test_what_cuda_takes_across_devices_passes():
    with EmulatedDevice():
        x = torch.randn(4, 3).to(DEVICE)
        rows, cols = torch.tensor([0, 2]), torch.tensor([1, 1])
        assert x[rows, cols].shape == (2,)                    # host indices
        x[rows, cols] = torch.zeros(2).to(DEVICE)
        assert (x * torch.tensor(2.0)).shape == (4, 3)       # a 0-dim host tensor is a scalar
        host = torch.empty(4, 3)
        host.copy_(x)                                       # a copy across devices
        assert (x.cpu() + host).shape == (4, 3)             # .cpu() is a host tensor


def test_a_no_op_move_leaves_the_host_original_on_the_host():
    """On the CPU ``t.to("cpu")`` returns ``t``: the mode keeps the two apart as a GPU would."""
    with EmulatedDevice() as mode:
        labels = torch.zeros(2, 3)
        moved = labels.to(DEVICE)
        assert mode.is_placed(moved) and mode.is_host(labels)
        with pytest.raises(DeviceMixError):
            torch.equal(moved, labels)


def test_results_follow_their_inputs_and_device_factories_are_neither():
    with EmulatedDevice() as mode:
        x = torch.ones(3).to(DEVICE)
        y = (x * 2).sum(0, keepdim=True)
        assert mode.is_placed(y)
        z = torch.zeros(3, device=DEVICE)  # device= may name a host tensor's device: never blamed
        assert not mode.is_placed(z) and not mode.is_host(z)
        assert (z + torch.ones(3)).shape == (3,) and (z + x).shape == (3,)
        w = torch.nn.Linear(3, 2)(torch.ones(3).to(DEVICE))  # parameters count as placed
        assert mode.is_placed(w)
        with pytest.raises(DeviceMixError):
            torch.nn.Linear(3, 2)(torch.ones(3))
