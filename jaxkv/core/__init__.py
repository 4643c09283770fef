"""The model core: config, parameters, the cache as pure data, and the computation of a
transformer over them (layers, attention, blocks, decoder, encoder); backends only through
jaxkv.ops."""

from jaxkv import submodules

__getattr__ = submodules(__name__)
