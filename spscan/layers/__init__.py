"""The layer library: one unit per layer type that knows its transposed-Jacobian pattern, how to
fill that pattern's values for a batch, its structured operator and its parameter-gradient rule.

One module per family (:mod:`~spscan.layers.linear`, :mod:`~spscan.layers.pooling`,
:mod:`~spscan.layers.elementwise`, :mod:`~spscan.layers.normalization`, :mod:`~spscan.layers.shape`,
:mod:`~spscan.layers.products` for products of two graph tensors),
the contract every unit keeps in :mod:`~spscan.layers.base` (:class:`LayerUnit`,
:class:`UnitCapabilities`), and one registry from module types and traced call targets to units in
:mod:`~spscan.layers.registry`.
"""

from spscan.layers.base import LayerUnit, UnitCapabilities, UnitOperator, _flat_index, _prod, coo_to_csr
from spscan.layers.elementwise import (DropoutUnit, ElementwiseMoreUnit, ElementwiseUnit, ParamAffineUnit, PReLUUnit,
                                       ScaleUnit, SoftmaxUnit)
from spscan.layers.linear import (ConvTransposeUnit, ConvUnit, EmbeddingUnit, LinearUnit, ReductionUnit,
                                  SeparableResampleUnit, _conv_entries)
from spscan.layers.normalization import BatchNormUnit, GroupNormUnit, LayerNormUnit, LowRankFactors
from spscan.layers.pooling import AvgPoolUnit, MaxPoolUnit
from spscan.layers.products import AttentionUnit, ProductUnit
from spscan.layers.registry import (NODE_UNITS, make_unit, supported_layer_types, supported_node_targets,
                                    unit_capabilities, unit_class)
from spscan.layers.shape import PerSampleReshapeUnit, ReshapeUnit, SelectionUnit, UnflattenUnit

__all__ = [
    "LayerUnit",
    "UnitCapabilities",
    "UnitOperator",
    "LinearUnit",
    "ConvUnit",
    "ElementwiseUnit",
    "MaxPoolUnit",
    "AvgPoolUnit",
    "BatchNormUnit",
    "DropoutUnit",
    "ReshapeUnit",
    "LayerNormUnit",
    "GroupNormUnit",
    "SoftmaxUnit",
    "ElementwiseMoreUnit",
    "PReLUUnit",
    "UnflattenUnit",
    "SeparableResampleUnit",
    "ConvTransposeUnit",
    "PerSampleReshapeUnit",
    "SelectionUnit",
    "ProductUnit",
    "AttentionUnit",
    "ScaleUnit",
    "ParamAffineUnit",
    "EmbeddingUnit",
    "ReductionUnit",
    "NODE_UNITS",
    "make_unit",
    "supported_layer_types",
    "supported_node_targets",
    "unit_class",
    "unit_capabilities",
    "coo_to_csr",
    "LowRankFactors",
]
