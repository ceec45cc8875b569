"""Recurrent layers (``nn.RNN``, ``nn.GRU``, ``nn.LSTM``): one fused ATen op over a flat list of weights.

For each layer and direction the hidden units are one space: the rows of every gate block of ``weight_ih`` and
``weight_hh`` and of both biases, the columns of ``weight_hh`` (which read the previous hidden state), and the
columns of the next layer's ``weight_ih`` (which read this layer's output, directions side by side). A permutation
of the units, applied to all of those, commutes with the elementwise gates, so it is a symmetry; scales do not
pass the sigmoids and tanh. The first layer's ``weight_ih`` columns are contracted with the input's features, as
in a linear layer. Anything this does not describe (projections, an initial state that differs per unit, inputs
whose channels are not their features) pins.
"""
from __future__ import annotations

import torch
from torch import fx

from .contraction import NEUTRAL
from .labels import Chan, Value, chan_axes, concrete_shape, ids_along


def rule_recurrent(w, node: fx.Node, spec) -> list[Value]:
    from .rules import _pin_moved, _schema_args

    args = _schema_args(node)
    layers, directions = args["num_layers"], 2 if args["bidirectional"] else 1
    per_layer = 4 if args["has_biases"] else 2
    params = list(args["params"])
    outputs = [concrete_shape(v.shape) for v in node.meta["val"]]
    if len(params) != layers * directions * per_layer:  # an LSTM with projections: weight_hr as well
        return _pin_moved(w, node, "recurrent layer with weights this rule does not describe (projections)")
    x = w.value(args["input"])
    feature_axis = len(x.shape) - 1
    if any(c.block or c.mixed or chan_axes(c) != {feature_axis} for c in x.chans):
        return _pin_moved(w, node, "recurrent layer over an input whose channels are not its features")
    ids = [_ids_per_axis(w.value(p)) for p in params]
    if any(i is None for i in ids):
        return _pin_moved(w, node, "recurrent layer whose weights are computed, not parameters read as they are")
    hidden_size = outputs[1][-1]
    units: list[torch.Tensor] = []  # one id vector per (layer, direction)
    for layer in range(layers):
        for direction in range(directions):
            first = (layer * directions + direction) * per_layer
            weights = ids[first:first + per_layer]
            hidden = w.ids.allocate(hidden_size)  # the state's units, as an activation
            for rows in [weights[0][0], weights[1][0], *[b[0] for b in weights[2:]]]:
                for gate in range(spec.gates):
                    w.c.tie(hidden, rows[gate * hidden_size:(gate + 1) * hidden_size], node=node.name)
            w.c.tie(hidden, weights[1][1], dual=True, node=node.name)  # weight_hh reads the previous state
            inputs = weights[0][1]
            if layer == 0:
                for c in x.chans:
                    w.c.tie(ids_along(c.ids, feature_axis), inputs, dual=True, node=node.name)
            else:
                previous = torch.cat(units[(layer - 1) * directions:layer * directions])
                w.c.tie(previous, inputs, dual=True, node=node.name)
            w.c.restrict(hidden, NEUTRAL, f"hidden units of a recurrent layer ({spec.gates} gates)", node.name)
            w.c.tag("activation", hidden)
            units.append(hidden)
    w.c.separate(torch.stack(units), node.name)  # directions side by side in one output: never mixed
    _initial_state(w, node, args["hx"], units)
    last = torch.cat(units[-directions:])
    states = torch.stack(units)[:, None, :]  # (layers * directions, 1, hidden)
    values = [Value(chans=[Chan.clean(last.expand(outputs[0]))], shape=outputs[0])]
    values += [Value(chans=[Chan.clean(states.expand(shape))], shape=shape) for shape in outputs[1:]]
    return values


def _ids_per_axis(v: Value | None) -> dict[int, torch.Tensor] | None:
    """A parameter read as it is: one clean channel along each axis, as {axis: 1-D ids}; else None."""
    if v is None or v.shape is None or any(c.block or c.mixed or len(chan_axes(c)) != 1 for c in v.chans):
        return None
    ids = {a: ids_along(c.ids, a) for c in v.chans for a in chan_axes(c)}
    return ids if sorted(ids) == list(range(len(v.shape))) and len(v.chans) == len(v.shape) else None


def _initial_state(w, node: fx.Node, hx, units: list[torch.Tensor]) -> None:
    """The initial hidden (and cell) state: zeros or one number for every unit move with any permutation; a state
    carrying units (an encoder's final state) is tied to them, row by row; anything else pins."""
    for state in hx if isinstance(hx, (list, tuple)) else [hx]:
        v = w.value(state) if isinstance(state, fx.Node) else None
        if v is None or (not v.chans and v.data is not None and _same_for_every_unit(v.data)):
            continue
        layer_axis = [c for c in v.chans if chan_axes(c) == {0}]  # a learned state's rows, one per layer
        rows = [c for c in v.chans if not (c.block or c.mixed) and chan_axes(c) <= {0, 2} and 2 in chan_axes(c)]
        if len(rows) == 1 and len(rows) + len(layer_axis) == len(v.chans):
            for c in layer_axis:
                w.c.pin(c.ids, "layers of a recurrent layer's initial state", node.name)
            for r, hidden in zip(rows[0].ids[:, 0, :], units):
                w.c.tie(hidden, r, node=node.name)
            continue
        for c in v.chans:
            for t in c.terms:
                w.c.pin(t.ids, "initial state of a recurrent layer this rule does not follow", node.name)
        for hidden in units:
            w.c.pin(hidden, "initial state of a recurrent layer that differs per unit", node.name)


def _same_for_every_unit(data) -> bool:
    data = torch.as_tensor(data)
    return data.dim() == 0 or bool((data == data[..., :1]).all())
