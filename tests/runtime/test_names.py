"""runtime/names.py: each call's layer name and op instance, resolved from the module that holds
the op's owner weight (the down projection's), cached per op instance."""

import torch
from torch import nn

from twell_compile.runtime import names


class Stack(nn.Module):
    """Calls ``names.resolve`` from inside its forward, as a compiled graph's op call is."""

    def __init__(self, layers=3):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"down": nn.Linear(4, 4)}) for _ in range(layers))

    def forward(self, i, instance, layer="layers.0"):
        return names.resolve(self.layers[i]["down"].weight, instance, layer)


def test_resolves_each_module_path_and_gives_other_owners_fresh_instances():
    net = Stack()
    op = names.next_instance()
    names.declare(op, "layers.0", "down.weight")
    got = [net(i, op) for i in range(3)]
    assert [layer for _, layer in got] == ["layers.0", "layers.1", "layers.2"]
    assert got[0][0] == op and len({i for i, _ in got}) == 3
    assert [net(i, op) for i in range(3)] == got          # cached: the same instance per module


def test_a_hit_walks_no_stack_and_survives_a_new_storage(monkeypatch):
    net = Stack()
    op = names.next_instance()
    names.declare(op, "layers.0", "down.weight")
    walks = []
    real = names.caller_modules
    monkeypatch.setattr(names, "caller_modules", lambda: walks.append(1) or real())
    first = net(1, op)
    assert walks == [1]
    net.layers[1]["down"].weight.data = torch.zeros(4, 4)      # FSDP2, .data =: the same Parameter
    assert net(1, op) == first and walks == [1]
    assert net(2, op)[1] == "layers.2" and walks == [1]         # the first walk named every parameter


def test_owner_outside_every_module_on_the_stack_keeps_the_compile_time_name():
    op = names.next_instance()
    names.declare(op, "mlp", "down.weight")
    w = nn.Parameter(torch.ones(2, 2))
    assert names.resolve(w, op, "mlp") == (op, "mlp")
    assert names.resolve(None, op, "mlp") == (op, "mlp")


def test_undeclared_op_keeps_its_arguments():
    assert Stack()(2, 0, "x") == (0, "x")          # a direct call of the op (instance 0)


def test_new_layer_hook_runs_once_per_other_layer():
    net = Stack()
    op = names.next_instance()
    names.declare(op, "layers.0", "down.weight")
    new = []
    names.on_new_layer(op, new.append)
    for _ in range(2):
        for i in range(3):
            net(i, op)
    assert new == ["layers.1", "layers.2"]


def test_a_new_parameter_object_at_a_known_place_keeps_its_instance():
    """A module's weight re-assigned each call (a new Parameter, as stateless calls make) keeps
    the instance of its (model, layer): no fresh runtime state per call."""
    net = Stack()
    op = names.next_instance()
    names.declare(op, "layers.0", "down.weight")
    first = [net(i, op) for i in range(3)]
    for _ in range(3):
        net.layers[1]["down"].weight = nn.Parameter(torch.randn(4, 4))
        assert net(1, op) == first[1]
    other = Stack()                                   # a second model: its own instances
    again = [other(i, op) for i in range(3)]
    assert [layer for _, layer in again] == ["layers.0", "layers.1", "layers.2"]
    assert not {i for i, _ in again} & {i for i, _ in first}
